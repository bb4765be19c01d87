"""The systems compared: how to set up, start, ask and drive each one. Used by benchmarks/peers/compare.py.

Each peer runs from its own virtual environment under benchmarks/peers/.venvs/<peer>, made from
benchmarks/peers/<peer>/requirements.txt (never a dependency of the project); this service runs with
the interpreter running this script, from the checkout given as --service-root.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the repository's root: benchmarks.peers is a package there
PEERS = ("ray", "kserve", "mlserver")


@dataclass(frozen=True)
class System:
    """One row of the table: a server to start, the request it takes, and where its boxes are in its answer."""

    name: str
    title: str
    peer: Optional[str]  # the venv's name; None for this service
    spare_workers: Optional[int] = None  # this service only
    precision: Optional[str] = None  # this service only: None, its default (auto)
    settings: dict = field(default_factory=dict)  # what changes its figures, for the docs


SYSTEMS = {
    "service": System("service", "this service (defaults: 1 spare worker, precision auto)", None, spare_workers=1,
                      settings={"max_batch_size": 16, "max_batch_delay_ms": 0, "inference_threads": 2,
                                "spare_workers": 1, "precision": "auto (bf16 where the CPU has native bf16)",
                                "protocol": "POST /detect, the JPEG as the body"}),
    "service-fp32": System("service-fp32", "this service, precision = fp32", None, spare_workers=1, precision="fp32",
                           settings={"max_batch_size": 16, "max_batch_delay_ms": 0, "inference_threads": 2,
                                     "spare_workers": 1, "precision": "fp32",
                                     "protocol": "POST /detect, the JPEG as the body"}),
    "service-no-spare": System("service-no-spare", "this service, spare_workers = 0", None, spare_workers=0,
                               settings={"max_batch_size": 16, "max_batch_delay_ms": 0, "inference_threads": 2,
                                         "spare_workers": 0, "precision": "auto",
                                         "protocol": "POST /detect, the JPEG as the body"}),
    "ray": System("ray", "Ray Serve", "ray",
                  settings={"@serve.batch": "max_batch_size=16, batch_wait_timeout_s=0.005",
                            "max_ongoing_requests": "64 (default 5)", "num_replicas": 1,
                            "ray.init": "include_dashboard=False",
                            "protocol": "POST /detect, the JPEG as the body"}),
    "kserve": System("kserve", "KServe Python server", "kserve",
                     settings={"ModelServer": "defaults (1 worker, no batcher: KServe's batcher is a "
                                              "Kubernetes sidecar)", "enable_grpc": False,
                               "protocol": "v1 :predict, {\"instances\": [{\"image\": {\"b64\": ...}}]}"}),
    "mlserver": System("mlserver", "MLServer", "mlserver",
                       settings={"adaptive batching": "max_batch_size=16, max_batch_time=0.005 s",
                                 "parallel_workers": "1 (default: inference in 1 worker process)",
                                 "protocol": "v2 JSON, BYTES input, base64 (content_type base64)"}),
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- virtual environments ---------------------------------------------------------------------------

def venv_python(venvs: Path, peer: str) -> Path:
    return venvs / peer / "bin" / "python"


def missing_venv(venvs: Path, peer: str) -> Optional[str]:
    """Why a peer cannot run (its venv is absent or out of date), or None."""
    stamp = venvs / peer / ".installed"
    if not venv_python(venvs, peer).exists() or not stamp.exists():
        return f"no virtual environment at {venvs / peer} (make it with benchmarks/peers/run --setup)"
    if stamp.read_text().strip() != _requirements_hash(peer):
        return f"{venvs / peer} is not installed from {HERE / peer / 'requirements.txt'} (run --setup)"
    return None


def setup_venv(venvs: Path, peer: str) -> None:
    """Make the peer's venv with python3 -m venv and pip install its pinned requirements (skipped if current)."""
    if missing_venv(venvs, peer) is None:
        return
    target = venvs / peer
    print(f"setting up {target} from {peer}/requirements.txt (TensorFlow included: minutes)", file=sys.stderr,
          flush=True)
    if not venv_python(venvs, peer).exists():
        subprocess.run(["python3", "-m", "venv", str(target)], check=True)
    pip = [str(venv_python(venvs, peer)), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(pip + ["-r", str(HERE / peer / "requirements.txt")], check=True)
    (target / ".installed").write_text(_requirements_hash(peer) + "\n")


def _requirements_hash(peer: str) -> str:
    return hashlib.sha256((HERE / peer / "requirements.txt").read_bytes()).hexdigest()


def peer_version(venvs: Path, peer: str) -> str:
    """The installed version of the peer's package (and TensorFlow's), read from its venv."""
    package = {"ray": "ray", "kserve": "kserve", "mlserver": "mlserver"}[peer]
    code = ("import importlib.metadata as m; "
            f"print(m.version('{package}'), m.version('tensorflow'))")
    done = subprocess.run([str(venv_python(venvs, peer)), "-c", code], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return "unknown"
    ours, tf = done.stdout.split()
    return f"{package} {ours}, tensorflow {tf}"


# --- starting ---------------------------------------------------------------------------------------

@dataclass
class Launch:
    """How to start one system: a command, its folder and environment, and how to talk to it."""

    command: list[str]
    cwd: Path
    env: dict
    port: int
    loadgen: dict  # keyword arguments of loadgen.spawn: the request format
    ask: Callable[[bytes], list[dict]]  # one JPEG -> its detections (raises on a failed request)


def launch(system: System, model: Path, service_root: Path, venvs: Path, work: Path) -> Launch:
    """Prepare the command that starts a system on a free port of 127.0.0.1 (config files written to `work`)."""
    port = free_port()
    name = model.name
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DETECT_", "PYTHONPATH"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    url = f"http://127.0.0.1:{port}"
    if system.peer is None:
        env.update(DETECT_PORT=str(port), DETECT_GRPC_PORT="off", DETECT_MODEL=str(model),
                   DETECT_SPARE_WORKERS=str(system.spare_workers), PYTHONPATH=str(service_root))
        if system.precision is not None:
            env["DETECT_PRECISION"] = system.precision
        return Launch([sys.executable, "-m", "app", "serve"], service_root, env, port, {"path": "/detect"},
                      lambda jpeg: _post(f"{url}/detect", jpeg, "image/jpeg")["detections"])
    python = str(venv_python(venvs, system.peer))
    env["PYTHONPATH"] = str(ROOT)  # where the peer's model file finds benchmarks.peers.common
    if system.peer == "ray":
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        return Launch([python, str(HERE / "ray" / "serve_app.py"), "--model", str(model), "--port", str(port)],
                      work, env, port, {"path": "/detect"},
                      lambda jpeg: _post(f"{url}/detect", jpeg, "image/jpeg")["detections"])
    if system.peer == "kserve":
        def ask_kserve(jpeg: bytes) -> list[dict]:
            body = {"instances": [{"image": {"b64": base64.b64encode(jpeg).decode()}}]}
            return _post(f"{url}/v1/models/{name}:predict", json.dumps(body).encode(),
                         "application/json")["predictions"][0]["detections"]

        return Launch([python, str(HERE / "kserve" / "model.py"), "--model_name", name, "--model_dir", str(model),
                       "--http_port", str(port), "--enable_grpc", "false"], work, env, port, {"v1_model": name},
                      ask_kserve)
    folder = work / "mlserver-config"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "settings.json").write_text(json.dumps({
        "host": "127.0.0.1", "http_port": port, "grpc_port": free_port(), "metrics_port": free_port()}))
    (folder / "model-settings.json").write_text(json.dumps({
        "name": name, "implementation": "runtime.Detector", "parameters": {"uri": str(model)},
        "max_batch_size": 16, "max_batch_time": 0.005}))
    env["PYTHONPATH"] = f"{ROOT}:{HERE / 'mlserver'}"  # and runtime.py, named by model-settings.json

    def ask_mlserver(jpeg: bytes) -> list[dict]:
        body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                            "parameters": {"content_type": "base64"}, "data": [base64.b64encode(jpeg).decode()]}]}
        answer = _post(f"{url}/v2/models/{name}/infer", json.dumps(body).encode(), "application/json")
        return json.loads(answer["outputs"][0]["data"][0])["detections"]

    return Launch([str(venvs / "mlserver" / "bin" / "mlserver"), "start", str(folder)], work, env, port,
                  {"v2_json_model": name}, ask_mlserver)


def _post(url: str, body: bytes, content_type: str, timeout_s: float = 30.0) -> dict:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def spares_ready(port: int, wanted: int) -> bool:
    """Whether this service has `wanted` spare workers with TensorFlow imported (True if it cannot say)."""
    if not wanted:
        return True
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/models", timeout=5) as answer:
            spares = json.loads(answer.read()).get("spares")
    except (OSError, ValueError, urllib.error.URLError):
        return False
    if spares is None:
        return True  # a checkout from before spares were listed
    return len(spares) >= wanted and all(spare.get("ready") for spare in spares)


def same_boxes(ours: list[dict], theirs: list[dict], pixels: float = 2.0, score: float = 0.02) -> Optional[str]:
    """None if two answers hold the same detections (class, box within `pixels`, score within `score`)."""
    if len(ours) != len(theirs):
        return f"{len(theirs)} detections, not {len(ours)}"
    for a, b in zip(ours, theirs):
        if a["class_id"] != b["class_id"]:
            return f"class {b['class_id']}, not {a['class_id']}"
        if abs(a["score"] - b["score"]) > score:
            return f"score {b['score']}, not {a['score']}"
        off = max(abs(a["box"][k] - b["box"][k]) for k in ("x_min", "y_min", "x_max", "y_max"))
        if off > pixels:
            return f"a box {off:.1f} px off"
    return None
