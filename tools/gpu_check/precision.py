"""The precision claims on a real GPU, for the day one is lent with TensorFlow: part of `scripts/gpu-check`.

Where TensorFlow is installed, a child process (`python -m tools.gpu_check.precision --child`, given the
GPU in CUDA_VISIBLE_DEVICES, so that TensorFlow never enters the checking process) loads the objects model
on that GPU with memory growth and settles its precision as a model's worker does (app/inference/parity.py,
precision auto). Checked:

1. auto chose by the GPU: fp16 on tensor cores (compute capability 7.0 and up), fp32 below;
2. fp16's answers on the reference photos pass the parity gate (a fail says what changed);
3. fp16 is faster than fp32 at batch 16 (a warning if not: a claim of speed, not of correctness).

Without TensorFlow (the lent machines have none: it is too large to carry) each is a skip that says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

from tools import ROOT
from tools.gpu_check.checks import FAIL, PASS, SKIP, WARN, Check

BATCH = 16
CHILD_TIMEOUT_S = 600.0


def precision_checks(gpu: int, run_child: Callable[[int], dict] = None) -> list[Check]:
    """The precision claims on GPU `gpu`: skipped without TensorFlow, else judged from the child's figures."""
    if run_child is None:
        if importlib.util.find_spec("tensorflow") is None:
            return [Check("precision: auto on the GPU", SKIP, "no TensorFlow here: the fp16 check needs TensorFlow "
                          "with CUDA (pip install tensorflow[and-cuda]); the NVML checks above do not")]
        run_child = run_in_child
    return judge(run_child(gpu))


def judge(result: dict) -> list[Check]:
    """Turn the child's figures into checks."""
    name = "precision: auto on the GPU"
    if "error" in result:
        return [Check(name, FAIL, f"the TensorFlow child failed: {result['error']}", result)]
    if not result.get("gpus"):
        return [Check(name, SKIP, "TensorFlow sees no GPU (a CPU-only TensorFlow?)", result)]
    capability = tuple(result["compute_capability"] or (0, 0))
    expected = "fp16" if capability >= (7, 0) else "fp32"
    execution = result["execution"]
    # fp16 kept the answers but was not faster at load: a claim of speed, so a warning, as check 3 is
    slower = expected == "fp16" and execution["gate"] == "passed" and (execution.get("speedup") or 2.0) < 1.05
    checks = [Check(name, PASS if execution["precision"] == expected else WARN if slower else FAIL,
                    f"{execution['precision']} on {result['gpus'][0]} (compute capability "
                    f"{'.'.join(map(str, capability))}; expected {expected}): {execution['reason']}", execution)]
    if expected == "fp16":
        parity = execution.get("parity") or {}
        checks.append(Check("precision: fp16 passes the parity gate", PASS if execution["gate"] == "passed" else FAIL,
                            f"{parity.get('matched')} of {parity.get('detections')} detections matched, scores "
                            f"within {parity.get('max_score_difference')}, IoU at least {parity.get('min_iou')}; "
                            f"{'; '.join(parity.get('problems') or []) or 'no problem'}", parity))
        fp32, fp16 = result["ms_per_image"]["fp32"], result["ms_per_image"]["fp16"]
        checks.append(Check(f"precision: fp16 faster than fp32 at batch {BATCH}", PASS if fp16 < fp32 else WARN,
                            f"{fp16} ms against {fp32} ms per image ({fp32 / fp16:.2f}x)", result["ms_per_image"]))
    return checks


def run_in_child(gpu: int) -> dict:
    """Run `child` in a process of its own; its last line of output is its JSON."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "TF_CPP_MIN_LOG_LEVEL": "2"}
    try:
        done = subprocess.run([sys.executable, "-m", "tools.gpu_check.precision", "--child"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {CHILD_TIMEOUT_S:g} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exit status {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:300]}"}
    return json.loads(lines[-1])


def child() -> dict:
    """In the child: settle the objects model's precision on the GPU, then time fp32 against fp16."""
    import numpy as np
    import tensorflow as tf

    from app.gpu.memory_policy import MemorySpec, apply_policy
    from app.inference.accelerators import apply_precision, read_hardware
    from app.inference.detector import load_detector
    from app.inference.parity import decoded_reference, settle_detector
    from app.settings import Settings

    apply_policy(MemorySpec(mode="growth"), None, lambda index: None)
    hardware = read_hardware()
    out = {"gpus": [g.name for g in hardware.gpus], "tensorflow": tf.__version__,
           "compute_capability": list(hardware.gpus[0].compute_capability or ()) if hardware.gpus else None}
    if not hardware.gpus:
        return out
    detector = load_detector(ROOT / "models" / "objects")
    defaults = Settings()
    out["execution"] = settle_detector(detector, "auto", True, defaults.default_threshold, defaults.max_image_pixels,
                                       hardware=hardware).to_json()
    pixels = decoded_reference(detector.model.path, defaults.max_image_pixels)[0][1].pixels
    batch = np.stack([pixels] * BATCH)
    out["ms_per_image"] = {}
    for precision in ("fp32", "fp16"):
        apply_precision(precision)
        for _ in range(3):
            detector.run(batch)
        times = []
        for _ in range(20):
            started = time.perf_counter()
            detector.run(batch)
            times.append(time.perf_counter() - started)
        out["ms_per_image"][precision] = round(1000 * statistics.median(times) / BATCH, 3)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check.precision")
    parser.add_argument("--child", action="store_true", required=True)
    parser.parse_args()
    print(json.dumps(child()))
