"""The chaos soak (scripts/chaos): a 2-minute run with a fixed seed against the shipped models, and its checker.

The run is the regression guard: every protocol at once while workers are killed and stopped, versions land
(good and corrupt), models are unloaded and loaded by request, bursts pass the queue, and the server ends with
SIGTERM under traffic. The checker's own tests feed it made-up runs, so that each rule is seen to bite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.chaos import report as chaos_report
from tools.chaos import run as chaos
from tools.chaos import traffic as chaos_traffic

ROOT = Path(__file__).resolve().parent.parent

SEED = 28


def test_a_two_minute_chaos_run_keeps_every_promise(tmp_path):
    out = tmp_path / "chaos"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    done = subprocess.run([sys.executable, "-m", "tools.chaos", "--duration", "120", "--seed",
                           str(SEED), "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    summary = done.stdout + done.stderr[-4000:]
    assert done.returncode == 0, summary
    report = json.loads((out / "chaos.json").read_text())
    assert all(check["passed"] for check in report["checks"].values()), summary
    # Every kind of request was sent and served, on both protocols, before, during and after the faults.
    assert set(report["by_kind"]) == set(chaos_traffic.KINDS), report["by_kind"]
    for kind, counts in report["by_kind"].items():
        wanted = {"slow-client": "closed", "bad-input": "400",
                  **{hang_up: str(chaos_traffic.HUNG_UP) for hang_up in chaos_report.HANG_UPS}}.get(kind, "200")
        assert counts.get(wanted, 0) > 0, (kind, counts)
    assert report["by_protocol"]["grpc"].get("200", 0) > 0 and report["by_protocol"]["http"].get("200", 0) > 0
    assert all(report["latency"][phase]["answers"] > 0 for phase in ("warm-up", "chaos", "settle"))
    # Faults landed, a worker was killed with requests in flight, and the server exited 0 at the end.
    assert sum(report["faults"].values()) >= 8 and report["faults"].get("kill-worker", 0) >= 1, report["faults"]
    assert report["in_flight_at_kills"] > 0 and report["exit_status"] == 0
    assert report["budget_peak_mib"] <= report["budget_mib"]
    assert (out / "chaos.png").stat().st_size > 10_000


# The checker, fed made-up runs --------------------------------------------------------------------------

PHASES = {"warm-up": 0.0, "chaos": 10.0, "settle": 20.0, "stop": 30.0, "end": 32.0}


def _record(t: float, **fields) -> dict:
    record = {"t": t, "rel_t": t, "kind": "detect-raw", "protocol": "http", "model": "shapes", "status": 200,
              "outcome": "ok", "expected": [200, 503, 504], "ms": 10.0}
    record.update(fields)
    record["phase"] = chaos_report.phase_of(t, PHASES)
    return record


def test_the_checker_finds_wrong_boxes_refusals_without_retry_after_and_lost_requests():
    records = [
        _record(1.0),
        _record(11.0, outcome="mismatch"),
        _record(12.0, status=503, error="overloaded"),  # no Retry-After
        _record(13.0, status=500, error="internal"),
        _record(14.0, status=0, outcome="reset"),
        _record(31.0, status=0, outcome="refused"),  # the port is closed during the stop: allowed
        _record(31.0, protocol="grpc", status=500, grpc="CANCELLED"),  # gRPC core's word at its shutdown: allowed
        # Sent 5 ms before the SIGTERM and answered after it, as in CI: still on its way, so allowed.
        _record(29.995, protocol="grpc", status=500, grpc="CANCELLED", ms=20.0),
        _record(17.0, protocol="grpc", status=500, grpc="CANCELLED"),  # answered before the stop: a problem
        # In a handler at the SIGTERM and cancelled when the 20 s grace ran out: abandoned, a problem.
        _record(29.0, protocol="grpc", status=500, grpc="CANCELLED", ms=21_000.0),
        _record(15.0, kind="slow-client", case="slowloris", outcome="held-open", closed_after_s=30.0, limit_s=4.0),
        _record(16.0, kind="bad-input", case="wrong-type", status=415, expected=[415, 503]),
    ]
    problems = chaos_report.check_answers(records, PHASES, grace_s=20.0)
    assert len(problems) == 7, problems
    assert [p.split(": ", 1)[1][:12] for p in problems] == [
        "status 200, ", "503 without ", "status 500 (", "no answer (r", "status 500 (", "status 500 (",
        "a slowloris "]
    assert "(CANCELLED)" in problems[4] and "at 17.0 s" in problems[4]
    assert "(CANCELLED)" in problems[5] and "at 29.0 s" in problems[5]


def test_the_checker_wants_requests_in_flight_at_a_kill_answered_200():
    faults = [{"t": 5.0, "fault": "kill-worker", "model": "objects", "pid": 1}]
    records = [_record(4.9, model="objects", ms=500.0), _record(4.8, model="objects", ms=400.0, status=503,
                                                                  error="model_unavailable"),
               _record(4.8, model="shapes", ms=400.0, status=503), _record(5.5, model="objects"),
               # A client that hung up on purpose while the worker died read no answer: not a crash's victim.
               _record(4.9, kind="hang-up", model="objects", ms=300.0, status=499),
               _record(4.9, kind="grpc-hang-up", model="objects", ms=300.0, status=499)]
    problems, in_flight = chaos_report.check_crashes(records, faults)
    assert in_flight == 2 and len(problems) == 1 and "status 503" in problems[0]
    # A request whose deadline ran out (it had waited for a load, then for the restart) may get 503 or 504 at it,
    # not before it.
    late = [_record(1.0, model="objects", ms=15_100.0, status=503, error="model_unavailable"),
            _record(1.0, model="objects", ms=14_000.0, status=503, error="model_unavailable"),
            _record(1.0, model="objects", ms=15_100.0, status=500, error="internal")]
    problems, in_flight = chaos_report.check_crashes(late, faults, deadline_s=15.0)
    assert in_flight == 3 and len(problems) == 2, problems
    assert "status 503" in problems[0] and "status 500" in problems[1]


def _sample(t: float, workers: list[str], rss: float = 300.0, threads: int = 100, fds: int = 60, lanes: int = 0):
    children = {str(1000 + i): {"role": role, "state": "S", "rss_mib": 500.0} for i, role in enumerate(workers)}
    return {"t": t, "http": {"rss_mib": rss, "threads": threads, "fds": fds, "lanes": lanes}, "children": children,
            "models": {"shapes": {"state": "ready"}}}


def test_the_checker_finds_a_budget_overrun_and_each_kind_of_leak():
    result = {"cap_mib": 1024, "overhead_mib": 300, "budget_mib": 2748, "lanes_per_worker": 2, "phases": PHASES}
    problems, peak = chaos_report.check_budget([_sample(1, ["shapes", "spare"]),
                                                _sample(2, ["shapes", "objects", "faces"])], result)
    assert peak == 3 * 1324 and len(problems) == 1 and "3972 MiB" in problems[0]
    steady = [_sample(5, ["shapes"], lanes=2), _sample(25, ["shapes"], lanes=2)]
    assert chaos_report.check_leaks(steady, result)[0] == []
    leaking = [_sample(5, ["shapes"], lanes=2),
               _sample(25, ["shapes"], rss=600.0, threads=120, fds=90, lanes=4)]
    problems, figures = chaos_report.check_leaks(leaking, result)
    assert figures["rss_mib"] == [300.0, 600.0] and len(problems) == 4, problems
    assert "private memory grew from 300.0 to 600.0 MiB" in problems[0], problems
    # Private memory is RssAnon where sampled: the lanes' shared memory moving with batch sizes is no leak,
    # and neither is a peak that has gone by the end of the window; a rise that stays is.
    private = [_sample(5, ["shapes"], rss=300.0), _sample(18, ["shapes"], rss=500.0),
               _sample(22, ["shapes"], rss=480.0), _sample(25, ["shapes"], rss=430.0)]
    for sample, anon in zip(private, (250.0, 420.0, 300.0, 400.0)):
        sample["http"]["anon_mib"] = anon
    problems, figures = chaos_report.check_leaks(private, result)
    assert problems == [] and figures["private_mib"] == [250.0, 300.0], (problems, figures)
    # What the faults leave in the allocator's heaps may stay, within LEAK_PRIVATE_MIB of the baseline...
    high = [_sample(5, ["shapes"]), _sample(21, ["shapes"]), _sample(24, ["shapes"]), _sample(29, ["shapes"])]
    for sample, anon in zip(high, (250.0, 480.0, 482.0, 484.0)):
        sample["http"]["anon_mib"] = anon
    problems, figures = chaos_report.check_leaks(high, result)
    assert problems == [] and figures["settle_private_mib"] == [482.0, 480.0], (problems, figures)
    for sample in high[1:]:
        sample["http"]["anon_mib"] = 520.0
    problems, _ = chaos_report.check_leaks(high, result)
    assert len(problems) == 1 and "grew from 250.0 to 520.0 MiB" in problems[0], problems
    # ...but memory that grows through the settle phase, where no fault runs, is a leak, however near the baseline.
    longer = {**result, "phases": {**PHASES, "stop": 50.0, "end": 52.0}}
    growing = [_sample(t, ["shapes"]) for t in (5, 21, 24, 35, 42, 49)]
    for sample, anon in zip(growing, (250.0, 260.0, 262.0, 280.0, 300.0, 310.0)):
        sample["http"]["anon_mib"] = anon
    problems, figures = chaos_report.check_leaks(growing, longer)
    assert len(problems) == 1 and "through the settle phase, with no fault, from 262.0 to 300.0" in problems[0], problems
    # A worker's lanes close a moment after it exits: one sample in that moment is not a leak; three are.
    exiting = [_sample(5, ["shapes"], lanes=2), _sample(23, ["shapes"], lanes=2), _sample(24, ["shapes"], lanes=2),
               _sample(25, ["shapes"], lanes=4)]
    assert chaos_report.check_leaks(exiting, result)[0] == []
    stuck = exiting[:1] + [{**exiting[-1], "t": t} for t in (23, 24, 25)]
    problems, _ = chaos_report.check_leaks(stuck, result)
    assert len(problems) == 1 and "4 memfd lanes mapped with 1 live workers (at most 2)" in problems[0], problems
    zombie = _sample(12, ["shapes"])
    zombie["children"]["1000"]["state"] = "Z"
    problems, _ = chaos_report.check_leaks([steady[0], zombie, {**zombie, "t": 13}, {**zombie, "t": 14}, steady[1]],
                                           result)
    assert len(problems) == 1 and "zombie" in problems[0]


def test_answers_are_compared_with_their_reference_within_what_batching_changes():
    reference = [(1, 10.0, 20.0, 110.0, 220.0, 0.91)]
    assert chaos_traffic.same([(1, 10.3, 19.8, 110.5, 220.4, 0.905)], reference)
    assert not chaos_traffic.same([(2, 10.0, 20.0, 110.0, 220.0, 0.91)], reference)  # another class
    assert not chaos_traffic.same([(1, 40.0, 20.0, 140.0, 220.0, 0.91)], reference)  # another box
    assert not chaos_traffic.same([], reference)


@pytest.mark.parametrize("boxes,scores,classes,rows", [
    ([[0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 1.0, 1.0]], [0.9, 0.2], [3.0, 1.0], [(3, 100.0, 200.0, 300.0, 400.0, 0.9)]),
    ([[0.1, 0.2, 0.3, 0.4]], [0.4], [3.0], []),
])
def test_raw_tensors_keep_the_detections_a_detect_answer_would(boxes, scores, classes, rows):
    got = chaos_traffic.tensors_of(boxes, scores, classes)
    assert len(got) == len(rows) and all(chaos_traffic.same([g], [r]) for g, r in zip(got, rows))


def test_the_checker_wants_every_connection_of_a_burst_answered():
    faults = [{"t": 3.0, "fault": "warm-up burst", "statuses": {"200": 150, "503": 10}},
              {"t": 15.0, "fault": "burst", "statuses": {"200": 140, "503": 17, "reset": 2, "-503": 1}}]
    problems = chaos_report.check_bursts(faults)
    assert sorted(problems) == ["burst at 15.0 s: 1 connection(s) got -503", "burst at 15.0 s: 2 connection(s) got reset"]


def test_every_503_in_every_protocol_says_when_to_come_back():
    # Found by the 30-minute run: KServe v2 answers a passed deadline 503 (as Triton does), and it had no
    # Retry-After, unlike every other 503.
    import app.errors as errors
    from app.http.errors import error_answer
    from app.http.paths import DETECT, V1, V2

    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.RequestError) and c is not errors.RequestError]
    seen = 0
    for cls in classes:
        for protocol in (DETECT, V1, V2):
            answer = error_answer(cls("a message"), protocol)
            if answer.status == 503:
                seen += 1
                assert ("Retry-After", "1") in answer.headers, (cls.__name__, protocol)
    assert seen >= 15  # NotReady, Overloaded, OutOfMemory, ModelUnavailable, InsufficientGpuMemory; v2's deadline


def test_the_faults_drawn_can_be_chosen_and_a_kind_it_does_not_know_is_refused():
    assert chaos.fault_weights("burst=5,kill-worker=2") == {"burst": 5, "kill-worker": 2}
    for bad in ("burst", "burst=0", "burst=x", "meteor=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            chaos.fault_weights(bad)


def test_a_run_may_put_models_in_one_worker_group_and_a_kill_of_its_worker_is_every_members():
    assert chaos.group_of("shapes,objects") == ["shapes", "objects"]
    for bad in ("shapes", "shapes,nope", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            chaos.group_of(bad)
    faults = [{"t": 5.0, "fault": "kill-worker", "model": "objects", "pid": 1, "models": ["objects", "shapes"]}]
    records = [_record(4.9, model="shapes", ms=500.0, status=503, error="model_unavailable"),
               _record(4.9, model="faces", ms=500.0, status=503)]
    problems, in_flight = chaos_report.check_crashes(records, faults)
    assert in_flight == 1 and len(problems) == 1 and "for shapes" in problems[0]


def test_a_worker_groups_worker_holds_lanes_for_each_of_its_models():
    sample = _sample(10.0, ["shapes", "faces"], lanes=6)
    sample["models"] = {"shapes": {"pid": 1000}, "objects": {"pid": 1000}, "faces": {"pid": 1001}}
    assert chaos_report._lane_holders(sample) == 3  # 2 lanes each: 6 mapped is no leak

