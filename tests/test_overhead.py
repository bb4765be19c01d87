"""benchmarks/overhead.py: what the service adds to one image, measured by turns with the in-process call.

A short real run on the shapes model: the service and the model in this test's subprocess, both timed.
Nothing here asserts how fast anything is: the machine is shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_overhead(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run `python -m benchmarks.overhead` on the shapes model with this interpreter; return it finished."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    command = [sys.executable, "-m", "benchmarks.overhead", "--model", str(ROOT / "models" / "shapes"), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_a_short_run_times_both_sides_by_turns_and_leaves_no_process_behind(tmp_path):
    done = run_overhead("--blocks", "2", "--per-block", "3", "--out", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("block ") == 2  # progress, a line a block
    result = json.loads((tmp_path / "overhead.json").read_text())
    assert result["requests"] == 6 and result["images"] == "scenes" and result["spare_workers"] == 0
    stages = result["stages_ms_p50"]
    assert {"receive", "decode", "send", "inference", "return"} <= set(stages)
    assert all(ms >= 0 for ms in stages.values()) and stages["inference"] > 0
    inside = result["in_process_ms_p50"]
    assert 0 < inside["decode"] < inside["total"] and 0 < inside["call"] < inside["total"]
    assert result["round_trip_ms_p50"] > stages["inference"]
    assert result["overhead_ms"] == round(result["round_trip_ms_p50"] - inside["total"], 2)
    assert result["stop"]["left"] == [] and result["stop"]["exit"] == "terminated"
    table = (tmp_path / "overhead.md").read_text()
    assert f"| **the service adds** | **{result['overhead_ms']}** |" in table


def test_a_service_that_exits_at_start_is_reported_not_waited_for(tmp_path):
    """A service root whose app exits at once (status 3): the run says so, and fails."""
    (tmp_path / "broken" / "app").mkdir(parents=True)
    (tmp_path / "broken" / "app" / "__init__.py").write_text("")
    (tmp_path / "broken" / "app" / "__main__.py").write_text("raise SystemExit(3)\n")
    done = run_overhead("--blocks", "1", "--per-block", "1", "--service-root", str(tmp_path / "broken"),
                        "--out", str(tmp_path / "out"), timeout=120)
    assert done.returncode == 1
    result = json.loads((tmp_path / "out" / "overhead.json").read_text())
    assert result["error"] == "RuntimeError: it exited with status 3"
    assert "requests" not in result and result["stop"]["left"] == []
    assert (tmp_path / "out" / "overhead.md").read_text().startswith("failed: RuntimeError: it exited with status 3")
