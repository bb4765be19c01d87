"""The chaos soak's verdict: what must hold, checked over every request and every sample; the summary and plot.

What must hold (issue 28):
- answers: every request gets what the documentation allows for it: 200, the refusal of its bad input (400,
  404, 413, 415), 503 with Retry-After when full or unavailable, 504 past the deadline; no other 5xx, no reset
  or closed connection, no answer with other detections than its own image's (checked against the reference
  answers), and every slow client closed at its deadline. During the stop, a refused connection is allowed
  (the port is closed), a reset one is not, and so is a gRPC CANCELLED answered after the SIGTERM and
  before the shutdown grace ran out (a call sent a moment before the SIGTERM may still be on its way): gRPC
  core cancels the calls it has received but not yet given a handler when its server shuts down
  (grpc/grpc#41785), where UNAVAILABLE would be the right word; the call was never started. A call
  cancelled at the grace's end would have been abandoned, and is a problem;
- crashes: every request for a model in flight when its worker was killed is answered 200, unless its
  deadline ran out first (a request that had waited for a load, then for the restart): then 503 or 504, at
  the deadline; a client that hung up on purpose reads no answer, and is not counted;
- budget: at every sample, the live workers' caps and overhead fit in the budget;
- leaks: the HTTP process's private memory (RssAnon, its heap: the lanes' shared memory is the lanes' check)
  does not grow through the settle phase by more than LEAK_SETTLE_MIB, and ends within LEAK_PRIVATE_MIB of the
  baseline (the end of the warm-up), taking its lowest over the last LEAK_WINDOW_S; its threads and
  descriptors within a few per worker more than it then had (threads: or than just after a burst, which
  grows the WSGI pool for good), and its memfd lanes those of its live workers only (a leak shows in each
  of the last LANE_SAMPLES samples, a worker that has just exited in one); no child stays a zombie; after the stop, no worker or spare is left and the exit status is 0.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional

# The HTTP process's private memory (RssAnon) keeps the high-water mark its allocator reached under the
# faults and bursts: a CI run ended 145 MiB above the baseline, flat through its settle phase (483.4 -> 483.8
# MiB), and the 30-minute soak ended lower than it began. So a leak is judged where it shows:
# the settle phase serves steady traffic with no fault, and private memory must not grow across it (its
# lowest over the last LEAK_WINDOW_S against its highest over the first LEAK_WINDOW_S / 2: a peak is no
# leak, and a leak does not go down). The baseline bounds what the faults may leave behind, grossly.
LEAK_SETTLE_MIB = 32.0
LEAK_PRIVATE_MIB = 256.0
LEAK_WINDOW_S = 10.0
PER_WORKER_THREADS = 4  # threads the HTTP process holds per live worker (reader, lanes' waiters)
PER_WORKER_FDS = 6  # descriptors per live worker (its channel, its lanes, its pidfd)
SLACK = 4
# A worker's lanes close a moment after it exits (once reaped, and its calls have let go of them): a sample in
# that moment shows them with the worker gone. A leak stays, so it must show in each of the last few samples.
LANE_SAMPLES = 3
REFUSALS = (400, 404, 413, 415)
# Requests whose client goes away on purpose: no answer is read, so a kill while one is out says nothing of it.
HANG_UPS = ("hang-up", "grpc-hang-up")
# Requests that are not answered 200 by design: refused input, clients too slow to be served, clients gone.
NOT_200_BY_DESIGN = ("bad-input", "slow-client", *HANG_UPS)


def load_requests(paths: list[Path]) -> list[dict]:
    records = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                records.append(json.loads(line))
    return sorted(records, key=lambda r: r["t"])


def phase_of(t: float, phases: dict) -> str:
    current = "warm-up"
    for name, start in sorted(phases.items(), key=lambda item: item[1]):
        if name != "end" and t >= start:
            current = name
    return current


def percentile(values: list[float], q: float):
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def check_answers(records: list[dict], phases: dict, grace_s: float) -> list[str]:
    problems = []
    for r in records:
        where = f"{r['phase']} {r['kind']} {r.get('model') or r.get('case', '')} at {r['rel_t']:.1f} s"
        if r["kind"] == "slow-client":
            if r["outcome"] == "refused" and r["phase"] == "stop":
                continue
            if r["outcome"] != "closed":
                problems.append(f"{where}: a {r['case']} held open {r['closed_after_s']} s (limit {r['limit_s']})")
            continue
        if r["status"] == 0:
            if not (r["phase"] == "stop" and r["outcome"] == "refused"):
                problems.append(f"{where}: no answer ({r['outcome']})")
            continue
        if r.get("grpc") == "CANCELLED" and _answered_in_the_stop(r, phases, grace_s):
            continue  # never started: gRPC core's word for a call its shutting-down server had not handed out
        if r["status"] not in r["expected"]:
            problems.append(f"{where}: status {r['status']} ({r.get('error') or r.get('grpc')}), "
                            f"allowed {r['expected']}")
        elif r["outcome"] != "ok":
            problems.append(f"{where}: status {r['status']}, {r['outcome']} {r.get('detail', '')}")
        elif r["status"] == 503 and r["protocol"] == "http" and not r.get("retry_after"):
            problems.append(f"{where}: 503 without Retry-After ({r.get('error')})")
    return problems


def _answered_in_the_stop(r: dict, phases: dict, grace_s: float) -> bool:
    """Answered after the SIGTERM (phases["stop"]) and before the shutdown grace could run out."""
    answered = r["rel_t"] + r.get("ms", 0.0) / 1000
    return "stop" in phases and phases["stop"] <= answered < phases["stop"] + grace_s


def check_bursts(faults: list[dict]) -> list[str]:
    """A burst's connections get 200 or 503 with Retry-After, like any other request."""
    return [f"{fault['fault']} at {fault['t']:.1f} s: {count} connection(s) got {status}"
            for fault in faults if fault["fault"].endswith("burst")
            for status, count in fault["statuses"].items() if status not in ("200", "503")]


def check_crashes(records: list[dict], faults: list[dict], deadline_s: Optional[float] = None
                  ) -> tuple[list[str], int]:
    """Requests in flight at a kill: answered 200, or, once their deadline (deadline_s) ran out, 503 or 504."""
    problems, in_flight = [], 0
    for fault in faults:
        if fault["fault"] != "kill-worker" or "model" not in fault:
            continue
        for r in records:
            if r.get("model") not in fault.get("models", [fault["model"]]) or "ms" not in r or r["kind"] in HANG_UPS:
                continue
            if r["rel_t"] < fault["t"] < r["rel_t"] + r["ms"] / 1000:
                in_flight += 1
                ran_out = deadline_s is not None and r["status"] in (503, 504) and r["ms"] >= deadline_s * 1000
                if r["status"] != 200 and not ran_out:
                    problems.append(f"{r['kind']} for {r['model']} in flight at the kill at {fault['t']:.1f} s: "
                                    f"status {r['status']} ({r.get('error') or r.get('grpc') or r['outcome']})")
    return problems, in_flight


def workers_in(sample: dict) -> list[dict]:
    return [c for c in sample["children"].values() if c["role"] not in ("spare", "?") and c["state"] != "Z"]


def check_budget(samples: list[dict], result: dict) -> tuple[list[str], int]:
    need = result["cap_mib"] + result["overhead_mib"]
    peak = 0
    problems = []
    for s in samples:
        used = need * len(workers_in(s))
        peak = max(peak, used)
        if used > result["budget_mib"]:
            problems.append(f"at {s['t']:.1f} s the live workers need {used} MiB of a {result['budget_mib']} MiB "
                            f"budget: {[c['role'] for c in workers_in(s)]}")
    return problems, peak


def _private_mib(sample: dict) -> float:
    """The HTTP process's private resident memory; all of it in runs recorded before RssAnon was sampled."""
    http = sample["http"]
    return http["anon_mib"] if http.get("anon_mib") is not None else http["rss_mib"]


def check_leaks(samples: list[dict], result: dict) -> tuple[list[str], dict]:
    phases, faults = result["phases"], result.get("faults", [])
    before = [s for s in samples if s["t"] < phases["chaos"]]
    settled = [s for s in samples if phases["settle"] <= s["t"] < phases["stop"]]
    if not before or not settled:
        return ["not enough samples for the leak checks"], {}
    base, end = before[-1], settled[-1]
    window = [s for s in settled if s["t"] >= end["t"] - LEAK_WINDOW_S]
    opening = [s for s in settled if s["t"] < phases["settle"] + LEAK_WINDOW_S / 2] or settled[:1]
    grown = max(0, len(workers_in(end)) + _spares(end) - len(workers_in(base)) - _spares(base))
    # Twisted's WSGI pool starts a thread per request it runs at once, up to http_threads, and keeps it: a burst
    # raises the count for good. So the threads compare with the most seen before the chaos or just after a
    # burst, whichever is higher; any other growth is a leak.
    bursts = [f["t"] for f in faults if f["fault"] == "burst"]
    after_bursts = [s["http"]["threads"] for s in samples if any(0 <= s["t"] - t <= 5 for t in bursts)]
    figures = {
        "baseline_t": base["t"], "end_t": end["t"],
        "rss_mib": [base["http"]["rss_mib"], end["http"]["rss_mib"]],
        "private_mib": [_private_mib(base), min(_private_mib(s) for s in window)],
        "settle_private_mib": [max(_private_mib(s) for s in opening), min(_private_mib(s) for s in window)],
        "threads": [max([s["http"]["threads"] for s in before] + after_bursts), end["http"]["threads"]],
        "fds": [max(s["http"]["fds"] for s in before), end["http"]["fds"]],
        "lanes": [base["http"]["lanes"], end["http"]["lanes"]],
        "workers": [len(workers_in(base)), len(workers_in(end))],
    }
    problems = []
    settle_from, settle_to = figures["settle_private_mib"]
    if settle_to > settle_from + LEAK_SETTLE_MIB:
        problems.append(f"the HTTP process's private memory grew through the settle phase, with no fault, from "
                        f"{settle_from} to {settle_to} MiB (allowed {LEAK_SETTLE_MIB:g})")
    if figures["private_mib"][1] > figures["private_mib"][0] + LEAK_PRIVATE_MIB:
        problems.append(f"the HTTP process's private memory grew from {figures['private_mib'][0]} to "
                        f"{figures['private_mib'][1]} MiB, its lowest over the last {LEAK_WINDOW_S:g} s "
                        f"(allowed {LEAK_PRIVATE_MIB:g})")
    if figures["threads"][1] > figures["threads"][0] + PER_WORKER_THREADS * grown + SLACK:
        problems.append(f"the HTTP process's threads went from {figures['threads'][0]} to {figures['threads'][1]}")
    if figures["fds"][1] > figures["fds"][0] + PER_WORKER_FDS * grown + SLACK:
        problems.append(f"the HTTP process's descriptors went from {figures['fds'][0]} to {figures['fds'][1]}")
    over = [s for s in settled[-LANE_SAMPLES:] if s["http"]["lanes"] > result["lanes_per_worker"] * _lane_holders(s)]
    if len(over) == min(LANE_SAMPLES, len(settled)):
        problems.append(f"{end['http']['lanes']} memfd lanes mapped with {len(workers_in(end))} live workers "
                        f"(at most {result['lanes_per_worker'] * _lane_holders(end)}) in each of the last "
                        f"{len(over)} samples")
    zombies = defaultdict(int)
    for s in samples:
        for pid, child in s["children"].items():
            if child["state"] == "Z":
                zombies[pid] += 1
                if zombies[pid] == 3:
                    problems.append(f"child {pid} ({child['role']}) stayed a zombie for 3 s from {s['t']:.1f} s")
    return problems, figures


def _lane_holders(sample: dict) -> int:
    """Models that may hold lanes: one per worker, or per model a worker group's worker serves, and the dead
    workers not yet reaped (whose lanes close after)."""
    served = Counter(m["pid"] for m in sample.get("models", {}).values() if m.get("pid"))
    workers = [pid for pid, c in sample["children"].items() if c in workers_in(sample)]
    return (sum(max(1, served.get(int(pid), 0)) for pid in workers)
            + sum(1 for c in sample["children"].values() if c["state"] == "Z"))


def _spares(sample: dict) -> int:
    return sum(1 for c in sample["children"].values() if c["role"] == "spare")


def report(result: dict, request_files: list[Path]) -> dict:
    phases = result["phases"]
    records = load_requests(request_files)
    for r in records:
        r["rel_t"] = r["t"] - result["t0_unix"]
        r["phase"] = phase_of(r["rel_t"], phases)
    checks = {}
    checks["answers"] = check_answers(records, phases, result["settings"]["shutdown_grace_s"])
    checks["bursts"] = check_bursts(result["faults"])
    crash_problems, in_flight_at_kills = check_crashes(records, result["faults"],
                                                       result["settings"]["request_deadline_s"])
    checks["crashes"] = crash_problems
    checks["budget"], peak = check_budget(result["samples"], result)
    checks["leaks"], leak_figures = check_leaks(result["samples"], result)
    checks["stop"] = ([] if result["exit_status"] == 0 else [f"exit status {result['exit_status']}"]) + [
        f"{role} process {pid} left behind" for pid, role in result["left_behind"].items()]
    by_kind: dict = defaultdict(Counter)
    for r in records:
        by_kind[r["kind"]][str(r["status"]) if r["status"] else r["outcome"]] += 1
    latency = {}
    for phase in ("warm-up", "chaos", "settle", "stop"):
        served = [r["ms"] for r in records if r["phase"] == phase and r["status"] == 200 and "ms" in r]
        latency[phase] = {"answers": len(served), "p50_ms": percentile(served, 0.5), "p99_ms": percentile(served, 0.99)}
    faults = Counter(f["fault"] for f in result["faults"]
                     if "skipped" not in f and f["fault"] not in ("warm-up burst", "warm-up grpc burst"))
    return {
        "passed": not any(checks.values()),
        "seed": result["seed"], "duration_s": result["duration_s"], "date": result["date"],
        "command": result["command"], "settings": result["settings"], "budget_mib": result["budget_mib"],
        "phases": phases, "requests": len(records), "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "by_status": dict(Counter(str(r["status"]) for r in records)),
        "by_protocol": {p: dict(Counter(str(r["status"]) for r in records if r["protocol"] == p))
                        for p in ("http", "grpc")},
        "latency": latency, "faults": dict(faults), "fault_log": result["faults"],
        "in_flight_at_kills": in_flight_at_kills, "budget_peak_mib": peak, "leaks": leak_figures,
        "dropped_images": result.get("dropped_images"),
        "checks": {name: {"passed": not found, "problems": found[:20], "count": len(found)}
                   for name, found in checks.items()},
        "exit_status": result["exit_status"],
        "rates": _rates(records),
    }


def _rates(records: list[dict]) -> dict:
    """Requests sent per second, and those not answered 200, by whole second of the run."""
    sent, refused = Counter(), Counter()
    for r in records:
        second = int(r["rel_t"])
        sent[second] += 1
        if r["status"] != 200 and r["kind"] not in NOT_200_BY_DESIGN:
            refused[second] += 1
    return {"sent": dict(sent), "not_200": dict(refused)}


def print_summary(rep: dict) -> None:
    print(f"chaos: seed {rep['seed']}, {rep['duration_s']:.0f} s, {rep['requests']} requests, faults "
          f"{json.dumps(rep['faults'])}")
    print(f"  by protocol: {json.dumps(rep['by_protocol'])}")
    for kind, counts in rep["by_kind"].items():
        print(f"  {kind:13s} {json.dumps(counts)}")
    for phase, figures in rep["latency"].items():
        print(f"  {phase:8s} {figures['answers']:6d} answers  p50 {figures['p50_ms']} ms  p99 {figures['p99_ms']} ms")
    print(f"  requests in flight at a kill: {rep['in_flight_at_kills']}; budget peak {rep['budget_peak_mib']} of "
          f"{rep['budget_mib']} MiB; leaks {json.dumps(rep['leaks'])}")
    print(f"  images dropped from the queue because their client had gone: {rep.get('dropped_images')}")
    for name, check in rep["checks"].items():
        print(f"  {'PASS' if check['passed'] else 'FAIL'} {name}" + "".join(f"\n      {p}" for p in check["problems"][:8])
              + (f"\n      ... {check['count'] - 8} more" if check["count"] > 8 else ""))
    print("chaos: " + ("every check passed" if rep["passed"] else "FAILED"))


def plot(result: dict, rep: dict, path: Path) -> None:
    """Memory by process over time with the faults marked, and requests per second below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    times = [s["t"] for s in samples]
    top.plot(times, [s["http"]["rss_mib"] for s in samples], label="HTTP process", color="black", lw=1.5)
    top.plot(times, [_private_mib(s) for s in samples], label="HTTP process, private (leak check)", color="black",
             lw=1, ls="--")
    roles = sorted({c["role"] for s in samples for c in s["children"].values() if c["role"] != "?"})
    for role in roles:
        values = [sum(c["rss_mib"] or 0 for c in s["children"].values() if c["role"] == role) or None for s in samples]
        top.plot(times, values, label=f"worker: {role}" if role != "spare" else "spare", lw=1)
    colours = {"kill-worker": "red", "stop-worker": "orange", "new-version": "green", "corrupt-version": "brown",
               "unload": "purple", "load": "violet", "burst": "blue", "sigterm": "black"}
    for fault in result["faults"]:
        colour = colours.get(fault["fault"])
        if colour and "skipped" not in fault:
            for axis in (top, bottom):
                axis.axvline(fault["t"], color=colour, lw=0.8, alpha=0.6)
    for name, colour in colours.items():
        top.plot([], [], color=colour, lw=0.8, label=name)
    top.set_ylabel("resident memory (MiB)")
    top.legend(loc="upper left", fontsize=7, ncol=3)
    phases = rep["phases"]
    for name in ("chaos", "settle", "stop"):
        if name in phases:
            top.text(phases[name], top.get_ylim()[1] * 0.98, f" {name}", fontsize=8, va="top")
    sent, refused = rep["rates"]["sent"], rep["rates"]["not_200"]
    seconds = sorted(int(s) for s in sent)
    bottom.plot(seconds, [sent.get(s, sent.get(str(s), 0)) for s in seconds], label="requests sent / s", lw=1)
    bottom.plot(seconds, [refused.get(s, refused.get(str(s), 0)) for s in seconds],
                label="good requests not answered 200 (503, 504) / s", lw=1, color="red")
    bottom.set_ylabel("per second")
    bottom.set_xlabel("seconds since the server was ready")
    bottom.legend(loc="upper left", fontsize=7)
    fig.suptitle(f"Chaos soak, seed {rep['seed']}, {rep['duration_s'] / 60:.0f} min, {rep['date']}: "
                 f"{rep['requests']} requests, {sum(rep['faults'].values())} faults, "
                 + ("every check passed" if rep["passed"] else "checks FAILED"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

