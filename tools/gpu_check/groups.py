"""Worker groups on a real GPU, for the day one is lent with TensorFlow: part of `scripts/gpu-check`.

Where TensorFlow is installed, a real server (`python -m app serve`, tools/server.py) serves the shipped
shapes and faces models in one worker group on the GPU, with objects beside them in a worker of its own, all
preloaded, no spare. Once it is ready, the check reads /models (each model's worker pid) and NVML's compute
processes on the GPU, then stops the server. Checked:

1. the group's two models name one worker pid, and objects another;
2. NVML lists the group's pid once on the GPU (one process, one CUDA context for both models), and objects'
   pid once: two contexts for three models, where a worker each would make three.

Without TensorFlow (the lent machines have none: it is too large to carry) it is a skip that says so.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Callable, Optional

from tools import ROOT
from tools.gpu_check.checks import FAIL, PASS, SKIP, Check

NAME = "worker group: one process and one context for its models"
GROUP = ("shapes", "faces")
ALONE = "objects"


def group_checks(gpu: int, run_server: Optional[Callable[[int], dict]] = None) -> list[Check]:
    """The worker-group claim on GPU `gpu`: skipped without TensorFlow, else judged from what the server showed."""
    if run_server is None:
        if importlib.util.find_spec("tensorflow") is None:
            return [Check(NAME, SKIP, "no TensorFlow here: a server's workers need TensorFlow with CUDA "
                          "(pip install tensorflow[and-cuda]); the NVML checks above do not")]
        run_server = serve_and_look
    return [judge(run_server(gpu))]


def judge(result: dict) -> Check:
    """`result`: {"pids": {model: its worker pid}, "gpu_pids": [each compute process NVML lists on the GPU]}."""
    if "error" in result:
        return Check(NAME, FAIL, f"the server failed: {result['error']}", result)
    pids, listed = result["pids"], list(result["gpu_pids"])
    group = {pids.get(model) for model in GROUP}
    problems = []
    if len(group) != 1 or None in group:
        problems.append(f"the group's models name {len(group - {None})} worker pid(s), not one: {pids}")
    if pids.get(ALONE) is None or pids.get(ALONE) in group:
        problems.append(f"{ALONE}, in a worker of its own, names pid {pids.get(ALONE)}")
    for model in (GROUP[0], ALONE):
        pid = pids.get(model)
        if pid is not None and listed.count(pid) != 1:
            problems.append(f"NVML lists {model}'s worker {pid} {listed.count(pid)} time(s) on the GPU, not once")
    detail = (f"{'; '.join(problems)}" if problems else
              f"{' and '.join(GROUP)} in one worker (pid {pids[GROUP[0]]}), one context on the GPU; {ALONE} in "
              f"pid {pids[ALONE]}: {len(set(listed))} compute processes listed for three models")
    return Check(NAME, FAIL if problems else PASS, detail, result)


def settings_text(gpu: int) -> str:
    """The server's settings: the shipped repository, the group at a 2 GiB cap, objects at its own 2 GiB."""
    lines = [f'model_repository = "{ROOT / "models"}"', f'gpus = "{gpu}"', 'gpu_memory = "2GiB"', "preload = true",
             "spare_workers = 0", "idle_unload_s = 0.0", 'grpc_port = "off"', f'default_model = "{ALONE}"']
    for model in GROUP:
        lines += [f"[models.{model}]", 'worker_group = "pair"']
    lines += ["[groups.pair]", 'gpu_memory = "2GiB"']
    return "\n".join(lines) + "\n"


def serve_and_look(gpu: int) -> dict:
    """Start the server, read /models and NVML once it is ready, stop it."""
    from app.gpu.nvml import Nvml
    from tools.server import ServerProcess

    with tempfile.TemporaryDirectory(prefix="gpu-check-groups-") as scratch:
        config = Path(scratch) / "server.toml"
        config.write_text(settings_text(gpu))
        try:
            server = ServerProcess.start(config, Path(scratch) / "server.log")
        except Exception as exc:  # a server that does not start is this check's failure, not the tool's
            return {"error": f"{type(exc).__name__}: {exc}"}
        try:
            rows = server.get_json("/models", timeout_s=30)["models"]
            nvml = Nvml.open()
            try:
                device = nvml.snapshot([gpu])[0]
            finally:
                nvml.close()
            return {"pids": {row["name"]: row.get("pid") for row in rows},
                    "gpu_pids": [process.pid for process in device.processes]}
        finally:
            server.stop()
