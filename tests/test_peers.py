"""The peer comparison (benchmarks/peers): its smoke run, and the process-tree sampler and stopper it relies on.

The smoke run needs none of the peers' virtual environments: pointed at an empty folder, it skips each peer
and says why. Nothing here asserts how fast anything is: the machine is shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.peers import proctree, systems

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_writes_the_table_and_leaves_no_process_behind(tmp_path):
    """This service runs end to end; peers without a venv are skipped with the reason, not failed."""
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the project's [tools] extra)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    out = tmp_path / "peers"
    done = subprocess.run([sys.executable, "-m", "benchmarks.peers.compare", "--smoke",
                           "--systems", "service,ray,kserve,mlserver",
                           "--venvs", str(tmp_path / "no-venvs"), "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    service, *peers = result["systems"]
    assert [s["connections"] for s in service["steps"]] == [1, 64]
    for step in service["steps"]:
        assert step["statuses"] == {str(200): step["requests"]} and step["errors"] == 0
        assert step["images_per_s"] > 0 and 0 < step["p50_ms"] <= step["p99_ms"]
        assert 0 < step["pss_mib_peak"] <= step["rss_mib_peak"] and step["processes"] >= 2  # HTTP + worker
        assert step["unique_mib_peak"] is None or 0 < step["unique_mib_peak"] <= step["rss_mib_peak"] * 1.1
        assert step["load_average"]["before"] and step["load_average"]["after"]
        assert 0 < step["client_cpu_percent"] <= 100
    assert service["check"].startswith("ok") and service["stop"]["left"] == []
    assert [p["system"] for p in peers] == ["ray", "kserve", "mlserver"]
    assert all("no virtual environment" in p["skipped"] for p in peers)
    assert result["ceiling"]["images_per_s"] > 0 and result["ceiling"]["single_image_ms_p50"] > 0
    assert service["at_rest"]["rss_mib"] > 0
    assert [g["goal"] for g in result["goals"]][:2] == ["p50 at 1 connection <= in-process single image + 1 ms",
                                                         "img/s at 64 >= 1.0 x in-process ceiling"]
    table = (out / "results.md").read_text()
    assert "| system | img/s at 64 | p50 / p99 at 1 (ms) | p50 / p99 at 64 (ms) | memory at rest, MiB" in table
    assert "| KServe Python server | skipped: no virtual environment" in table
    assert (out / "results.png").read_bytes().startswith(b"\x89PNG")
    assert proctree.tree(service["pid"]) == []


# A leader that starts a child in a process group of its own (as Ray's raylet starts its actors) and, on
# SIGTERM, stops it before exiting; the child fills 64 MiB and, with IGNORE, shrugs off SIGTERM.
TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", '''
    import os, signal, sys, time
    os.setpgrp()
    if sys.argv[1] == "IGNORE":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    block = bytearray(b"x" * (64 * 2**20))
    print("ready", flush=True)
    time.sleep(600)
    ''', sys.argv[1]], stdout=sys.stdout)
    def stop(*_):
        child.terminate()
        try:
            child.wait(timeout=5)
        finally:
            sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    time.sleep(600)
""")


def start_tree(mode: str) -> subprocess.Popen:
    leader = subprocess.Popen([sys.executable, "-c", TREE, mode], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert leader.stdout.readline().strip() == "ready"
    return leader


def test_sampler_sums_rss_and_pss_over_the_leader_and_a_child_in_its_own_group():
    leader = start_tree("OBEY")
    try:
        pids = proctree.tree(leader.pid)
        assert len(pids) == 2 and leader.pid in pids
        figures = proctree.sample(leader.pid, unique=True)
        assert figures["processes"] == 2
        assert figures["rss_mib"] >= 64 and 64 <= figures["pss_mib"] <= figures["rss_mib"]
        if figures["unique_mib"] is not None:  # None unless root: frame numbers are hidden from others
            assert 64 <= figures["unique_mib"] <= figures["rss_mib"] + 1
        sampled = proctree.Tree(leader.pid)
        samples = [sampled.stats() for _ in range(3)]
        assert set(sampled.seen) == set(pids) and proctree.peak(samples)["rss_mib"] >= 64
    finally:
        stopped = proctree.stop(leader.pid, proctree.identities(pids), timeout_s=10)
        leader.wait()
        leader.stdout.close()
    assert stopped == {"exit": "terminated", "killed": [], "left": []}


def test_stop_kills_what_ignores_sigterm_and_leaves_nothing():
    leader = start_tree("IGNORE")
    pids = proctree.tree(leader.pid)
    stopped = proctree.stop(leader.pid, proctree.identities(pids), timeout_s=1)
    leader.wait()
    leader.stdout.close()
    assert stopped["exit"] == "killed" and stopped["left"] == []
    assert set(pids) - {leader.pid} <= set(stopped["killed"])
    assert proctree.tree(leader.pid) == []


def test_same_boxes_allows_rounding_but_not_a_different_answer():
    box = {"x_min": 10.0, "y_min": 20.0, "x_max": 110.0, "y_max": 220.0}
    ours = [{"class_id": 1, "score": 0.9, "box": box}]
    assert systems.same_boxes(ours, [{"class_id": 1, "score": 0.91, "box": {**box, "x_min": 11.5}}]) is None
    assert "px off" in systems.same_boxes(ours, [{"class_id": 1, "score": 0.9, "box": {**box, "y_max": 230.0}}])
    assert "class" in systems.same_boxes(ours, [{"class_id": 2, "score": 0.9, "box": box}])
    assert "0 detections" in systems.same_boxes(ours, [])
