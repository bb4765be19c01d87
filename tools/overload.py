"""Drive the service at 4x its sustainable load and check that it stays honest and recovers.

1. Sizing (unless --max-queue is given), on a server whose queue cannot fill: capacity from a
   closed loop at 2 x max_batch_size connections; the 1x load is `--load-fraction` of it, sent at
   exponential gaps as from independent clients (`--arrivals uniform`: even gaps), and lowered, at
   most twice, while over 1% of it gets 503, so 1x is a load the service sustains with a low p99;
   max_queue is then what the model clears in 3/4 of the 1x p99 (`size_queue`).
2. On a server with the chosen settings (printed; see `overload_settings`): the 1x load again,
   then four times its rate for `--duration` seconds; as that stops, a probe at the 1x rate starts
   in another process and watches latency come back.

Checks: during 4x only 200 or 503 come back, no other status and no connection failure of any
kind (reset, closed early, timeout); every 503 carries Retry-After; p99 of the admitted (200)
requests is at most 2x the p99 at 1x; after the load stops, latency is back to normal (every
1-second window of the probe all 200 with a median within the 1x p99 or 2x its p50, from some point on)
within 10 s. Prints a verdict; exit status 0 if every check passes, 1 if one fails, 2 if it
could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

from tools import ROOT, loadgen
from tools.images import make_images
from tools.load_step import drive
from tools.samplers import StatsSampler, load_average
from tools.server import ServerProcess, default_model, write_settings

RECOVERY_LIMIT_S = 10.0
PROVISIONAL_QUEUE = 100000  # while sizing: no 503 from the queue
SUSTAINED_503_SHARE = 0.01  # a load is sustained if at most this share of its requests get 503


QUEUE_WAIT_SHARE = 0.75  # of the 1x p99: how long an admitted image may wait in a full queue


def overload_settings(args, max_queue: int) -> dict:
    """Return the settings under which overload is answered with 503 at once rather than queued.

    - max_queue sized in time (see `size_queue`): a full queue holds what the model clears in
      QUEUE_WAIT_SHARE of the 1x p99, so an admitted request waits at most about that long;
    - http_threads, the /detect requests admitted at once, the server's default unless given;
    - request_deadline_s well above what an admitted request can wait, so a 504 means a fault.
    """
    settings = {"model": str(args.model), "max_queue": max_queue, "request_deadline_s": args.deadline}
    if args.http_threads:
        settings["http_threads"] = args.http_threads
    return {**settings, **args.settings}


def size_queue(capacity_per_s: float, p99_1x_ms: float) -> int:
    """Return the queue bound that the model clears in QUEUE_WAIT_SHARE of the 1x p99 (Little's law)."""
    return max(1, int(QUEUE_WAIT_SHARE * capacity_per_s * p99_1x_ms / 1000.0))


def choose_max_queue(images: Path, out: Path, args, measure_s: float, base_s: float) -> tuple[int, dict]:
    """Measure capacity and 1x on a server whose queue cannot fill; return the sized queue and the figures."""
    effective = write_settings(out / "server.toml", overload_settings(args, PROVISIONAL_QUEUE))
    server = ServerProcess.start(out / "server.toml", out / "sizing-server.log")
    try:
        sizing = measure_1x(server, images, out, effective, args, measure_s, base_s, "sizing")
    finally:
        server.stop()
    max_queue = size_queue(sizing["capacity"]["ok_per_s"], sizing["base"]["latency_ms"]["p99"])
    print(f"   max_queue = {QUEUE_WAIT_SHARE:g} x {sizing['capacity']['ok_per_s']:.2f} images/s x 1x p99 "
          f"{sizing['base']['latency_ms']['p99']:.0f} ms = {max_queue} images", file=sys.stderr)
    return max_queue, sizing


def recovery(probe: dict, offset_s: float, p50_1x: float, p99_1x: float) -> dict:
    """Find when the probe's latency is back to normal; `offset_s` is the probe's start after the load stopped.

    A 1-second window is normal when all its answers are 200 and its median is within what 1x
    itself shows (at most its p99, or twice its p50 where that is more: the machine is shared).
    """
    windows: dict[int, list] = {}
    for sent, latency_ms, status in probe["records"]:
        windows.setdefault(int(sent + offset_s), []).append((latency_ms, status))
    bound = max(2 * p50_1x, p99_1x)
    table = []
    for second in sorted(windows):
        latencies = sorted(lat for lat, _ in windows[second])
        median = latencies[(len(latencies) - 1) // 2]
        all_ok = all(status == 200 for _, status in windows[second])
        table.append({"second": second, "requests": len(latencies), "median_ms": round(median, 1),
                      "all_200": all_ok, "normal": all_ok and median <= bound})
    recovered = None
    for i, window in enumerate(table):
        if all(w["normal"] for w in table[i:]) and len(table) - i >= 2:
            recovered = window["second"]
            break
    return {"bound_ms": round(bound, 1), "recovered_after_s": recovered, "windows": table}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/overload", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model base path (default: shapes, else faces)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "overload", help="output folder")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of 4x load (default 60)")
    parser.add_argument("--load-fraction", type=float, default=0.7, help="1x load as a share of capacity")
    parser.add_argument("--factor", type=float, default=4.0, help="overload as a multiple of 1x (default 4)")
    parser.add_argument("--connections", type=int, default=48, help="connections for the overload")
    parser.add_argument("--arrivals", choices=("poisson", "uniform"), default="poisson",
                        help="gaps between sends: exponential, as from independent clients (default), or even "
                             "(a 1x with almost no queueing: the strictest baseline for the p99 check)")
    parser.add_argument("--probe-duration", type=float, default=None,
                        help="seconds the recovery probe runs after the load stops (default 12)")
    parser.add_argument("--http-threads", type=int, default=None, help="server http_threads (default: the server's)")
    parser.add_argument("--max-queue", type=int, default=None,
                        help="server max_queue (default: sized from capacity and the 1x p99 on a first server)")
    parser.add_argument("--deadline", type=float, default=10.0, help="server request_deadline_s (default 10)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="another server setting")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.model = (args.model or default_model()).resolve()
    args.settings = dict(item.split("=", 1) for item in args.set)
    short = args.duration < 30
    measure_s = 3.0 if short else 10.0
    base_s = 4.0 if short else 20.0
    probe_s = args.probe_duration or RECOVERY_LIMIT_S + 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        images = make_images(out / "images")
        print(f"overload: model {args.model}; load average {load_average()} on {os.cpu_count()} CPUs "
              "(shared machine)", file=sys.stderr)
        max_queue, sizing = args.max_queue, None
        if max_queue is None:
            max_queue, sizing = choose_max_queue(images, out, args, measure_s, base_s)
        effective = write_settings(out / "server.toml", overload_settings(args, max_queue))
        print("server settings for the overload run: " + ", ".join(
            f"{k}={effective[k]}" for k in ("http_threads", "max_queue", "request_deadline_s", "max_batch_size",
                                             "max_batch_delay_ms", "inference_threads")), file=sys.stderr, flush=True)
        server = ServerProcess.start(out / "server.toml", out / "server.log")
        try:
            measured = measure_1x(server, images, out, effective, args, measure_s, base_s, "run", known=sizing)
            result = run_overload(server, images, out, args, measured, probe_s)
        finally:
            result_exit = server.stop()
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"overload: error: {exc}", file=sys.stderr)
        return 2
    if sizing is not None:
        result["queue_sizing"] = {"capacity_per_s": sizing["capacity"]["ok_per_s"], "rate_1x": sizing["rate"],
                                  "p99_1x_ms": sizing["base"]["latency_ms"]["p99"], "share": QUEUE_WAIT_SHARE,
                                  "max_queue": max_queue}
    result["server_exit"] = result_exit
    result["settings"] = effective
    (out / "overload.json").write_text(json.dumps(result, indent=1))
    print_verdict(result)
    print(f"wrote {out / 'overload.json'}", file=sys.stderr)
    return 0 if all(check["passed"] for check in result["checks"]) else 1


def measure_1x(server, images: Path, out: Path, effective: dict, args, measure_s: float, base_s: float,
               tag: str, known: Optional[dict] = None) -> dict:
    """Measure capacity (closed loop; or take `known`'s) and a 1x paced load sustained with at most 1% 503."""
    closed = min(2 * effective["max_batch_size"], effective["max_queue"], effective["http_threads"])
    drive(server, images, out / "warmup.json", "warm-up", 4, 1.0 if measure_s < 5 else 3.0)
    if known is not None:
        capacity, rate = known["capacity"], known["rate"]
    else:
        print(f"{tag}: capacity: closed loop at {closed} connections for {measure_s:g} s", file=sys.stderr,
              flush=True)
        capacity = drive(server, images, out / f"capacity-{tag}.json", "capacity", closed, measure_s)
        rate = args.load_fraction * capacity["ok_per_s"]
    if rate <= 0:
        raise RuntimeError(f"no capacity measured: {capacity['statuses']} {capacity['errors']}")
    connections = max(2 * effective["max_batch_size"], 4)
    base = None
    for _ in range(3):
        print(f"{tag}: 1x load: {rate:.2f} requests/s for {base_s:g} s", file=sys.stderr, flush=True)
        base = drive(server, images, out / f"base-{tag}.json", "1x", connections, base_s, rate=rate,
                           arrivals=args.arrivals)
        if base["statuses"].get("503", 0) <= SUSTAINED_503_SHARE * base["requests"] and base["error_total"] == 0:
            break
        rate *= 0.8  # the service did not sustain it: lower the 1x load
    print(f"   capacity {capacity['ok_per_s']:.2f} images/s; 1x {base['ok_per_s']:.2f} images/s, p50 "
          f"{base['latency_ms']['p50']} ms, p99 {base['latency_ms']['p99']} ms", file=sys.stderr)
    return {"capacity": capacity, "base": base, "rate": rate, "connections": connections}


def run_overload(server, images: Path, out: Path, args, measured: dict, probe_s: float) -> dict:
    """Drive factor x the 1x rate, probe at 1x as it stops, and check the outcome."""
    capacity, base, rate = measured["capacity"], measured["base"], measured["rate"]
    p50_1x, p99_1x = base["latency_ms"]["p50"], base["latency_ms"]["p99"]
    over_rate = args.factor * rate
    print(f"{args.factor:g}x load: {over_rate:.2f} requests/s ({args.arrivals} arrivals) on {args.connections} "
          f"connections for {args.duration:g} s, then a probe at 1x for {probe_s:g} s", file=sys.stderr, flush=True)
    over_out, probe_out = out / "overload-load.json", out / "probe.json"
    load_before = load_average()
    with StatsSampler(server) as sampler:
        over = loadgen.spawn(server.port, images, over_out, args.connections, args.duration, rate=over_rate,
                             timeout_s=60.0, records=True, label=f"{args.factor:g}x", arrivals=args.arrivals,
                             seed=1)
        probe = loadgen.spawn(server.port, images, probe_out, measured["connections"], probe_s, rate=rate,
                              timeout_s=60.0, arrivals=args.arrivals, seed=2,
                              start_delay_s=args.duration, records=True, label="probe")
        over_result = loadgen.collect(over, over_out, args.duration + 120)
        probe_result = loadgen.collect(probe, probe_out, args.duration + probe_s + 120)
    stopped_at = over_result["started_at"] + over_result["stopped_sending_s"]
    offset = probe_result["started_at"] - stopped_at
    back = recovery(probe_result, offset, p50_1x, p99_1x)

    statuses = {int(k): v for k, v in over_result["statuses"].items()}
    admitted = over_result["latency_ms"]
    others = {code: n for code, n in statuses.items() if code not in (200, 503)}
    probe_errors = probe_result["error_total"]
    checks = [
        {"check": "only 200 or 503 under overload", "passed": not others,
         "detail": f"statuses {over_result['statuses']}"},
        {"check": "no connection resets or other connection failures", "passed": over_result["error_total"] == 0
         and probe_errors == 0, "detail": f"overload {over_result['errors']}, probe {probe_result['errors']}"},
        {"check": "every 503 has Retry-After", "passed": over_result["retry_after_missing"] == 0,
         "detail": f"{over_result['retry_after_missing']} without"},
        {"check": "p99 of admitted requests <= 2 x p99 at 1x",
         "passed": admitted["p99"] is not None and admitted["p99"] <= 2 * p99_1x,
         "detail": f"{admitted['p99']} ms vs 2 x {p99_1x} = {2 * p99_1x:.1f} ms"},
        {"check": f"latency back to normal within {RECOVERY_LIMIT_S:g} s after the load stops",
         "passed": back["recovered_after_s"] is not None and back["recovered_after_s"] <= RECOVERY_LIMIT_S,
         "detail": f"normal from second {back['recovered_after_s']} (median <= {back['bound_ms']} ms, all 200)"},
    ]
    for result in (over_result, probe_result):
        result.pop("records")
    return {
        "model": str(args.model),
        "load_average": {"start": load_before, "end": load_average()},
        "capacity": _brief(capacity), "base": _brief(base), "rate_1x": round(rate, 2),
        "arrivals": args.arrivals,
        "overload": {**_brief(over_result), "rate": round(over_rate, 2), "connections": args.connections,
                     "duration_s": args.duration, "latency_ms_by_status": over_result["latency_ms_by_status"],
                     "late_sends": over_result["late_sends"], "max_lateness_ms": over_result["max_lateness_ms"],
                     "retry_after_missing": over_result["retry_after_missing"],
                     "rss_mb_peak": max((s["rss_mb"] for s in sampler.samples), default=None),
                     "threads_peak": max((s["threads"] for s in sampler.samples), default=None)},
        "probe": {**_brief(probe_result), "started_after_stop_s": round(offset, 3)},
        "recovery": back,
        "checks": checks,
    }


def _brief(result: dict) -> dict:
    return {key: result[key] for key in ("requests", "statuses", "errors", "error_total", "ok_per_s",
                                         "requests_per_s", "latency_ms", "elapsed_s") if key in result}


def print_verdict(result: dict) -> None:
    over = result["overload"]
    busy = over["latency_ms_by_status"].get("503", {})
    print(f"\ncapacity {result['capacity']['ok_per_s']:.2f} images/s; 1x = {result['rate_1x']:.2f} requests/s "
          f"(p50 {result['base']['latency_ms']['p50']} ms, p99 {result['base']['latency_ms']['p99']} ms)\n"
          f"{over['rate']:.2f} requests/s offered for {over['duration_s']:g} s: {over['statuses']}, admitted "
          f"{over['ok_per_s']:.2f}/s, admitted p50/p99 {over['latency_ms']['p50']}/{over['latency_ms']['p99']} ms, "
          f"503 p99 {busy.get('p99')} ms, {over['late_sends']} late sends; load average {result['load_average']}",
          file=sys.stderr)
    for check in result["checks"]:
        print(f"  {'PASS' if check['passed'] else 'FAIL'}  {check['check']}: {check['detail']}", file=sys.stderr)
    passed = all(check["passed"] for check in result["checks"])
    print(f"verdict: {'PASS' if passed else 'FAIL'}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
