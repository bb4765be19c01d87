"""Soak the service: 10 000 requests at about 70% of capacity, watching memory, threads and descriptors.

The server runs on the code defaults of app/settings.py (plus any --set), so the defaults are what
is soaked. Capacity is measured with a closed loop at 2 x max_batch_size connections; then one
paced run at `--fraction` of it sends a warm-up (a tenth of the requests, at least 100) and the
soak, while /proc/<pid> is sampled every half second. The first sample after the warm-up is the
baseline. Checks: RSS growth after warm-up under 50 MB (last sample and peak); the same thread
and descriptor counts in every later sample; no 5xx and no connection failures. Prints the
figures; exit status 0 if every check passes, 1 if one fails, 2 if it could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tools import ROOT
from tools.images import make_images
from tools.load_step import drive
from tools.samplers import load_average
from tools.server import ServerProcess, default_model, write_settings

SMOKE_MIN_S = 10.0  # the smoke run lasts at least this long, so samples follow the warm-up
# A model worker's memory grows while it meets the batch sizes an open loop brings; a short warm-up
# would count that as growth, so the smoke spends 4 s of its 10 on warming up.
SMOKE_WARMUP = 200
GROWTH_LIMIT_MB = 50.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model base path (default: shapes, else faces)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "soak", help="output folder")
    parser.add_argument("--requests", type=int, default=None, help="requests in the soak (default 10000, smoke 300)")
    parser.add_argument("--fraction", type=float, default=0.7, help="soak rate as a share of capacity")
    parser.add_argument("--connections", type=int, default=16, help="connections (default 16)")
    parser.add_argument("--smoke", action="store_true", help="short CI mode: 300 requests after a short warm-up")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a server setting")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    model = (args.model or default_model()).resolve()
    total = args.requests or (300 if args.smoke else 10_000)
    warmup = SMOKE_WARMUP if args.smoke else max(100, total // 10)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        images = make_images(out / "images")
        settings = write_settings(out / "server.toml", {"model": str(model),
                                                              **dict(s.split("=", 1) for s in args.set)})
        connections = min(args.connections, settings["http_threads"])
        print(f"soak: model {model}, {total} requests after {warmup} warm-up; load average "
              f"{load_average()} on {os.cpu_count()} CPUs (shared machine)", file=sys.stderr, flush=True)
        server = ServerProcess.start(out / "server.toml", out / "server.log")
        try:
            result = soak(server, images, out, settings, total, warmup, connections, args)
        finally:
            result_exit = server.stop()
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"soak: error: {exc}", file=sys.stderr)
        return 2
    result["server_exit"] = result_exit
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    print_figures(result)
    print(f"wrote {out / 'soak.json'}", file=sys.stderr)
    return 0 if all(check["passed"] for check in result["checks"]) else 1


def soak(server, images: Path, out: Path, settings: dict, total: int, warmup: int, connections: int,
         args) -> dict:
    closed = min(2 * settings["max_batch_size"], settings["max_queue"])
    measure_s = 3.0 if args.smoke else 10.0
    print(f"capacity: closed loop at {closed} connections for {measure_s:g} s", file=sys.stderr, flush=True)
    capacity = drive(server, images, out / "capacity.json", "capacity", closed, measure_s)
    rate = args.fraction * capacity["ok_per_s"]
    if rate <= 0:
        raise RuntimeError(f"no capacity measured: {capacity['statuses']} {capacity['errors']}")
    if args.smoke:
        # A fast model would finish the few smoke requests before the warm-up's samples are over.
        rate = min(rate, (warmup + total) / SMOKE_MIN_S)
    # Warm-up and soak are one run, so the connections stay open: the baseline is the first sample
    # taken once the warm-up requests have had their time, and every later sample must match it.
    warm_s = warmup / rate + 1.0
    print(f"{warmup} warm-up + {total} requests at {rate:.2f}/s ({rate / capacity['ok_per_s']:.0%} of {capacity['ok_per_s']:.2f}/s) "
          f"on {connections} connections: about {(warmup + total) / rate / 60:.1f} min", file=sys.stderr, flush=True)
    main_run = drive(server, images, out / "soak-load.json", "soak", connections, 3600,
                           requests=warmup + total, rate=rate)
    # Past the last send the load generator starts closing its connections: those samples are left out.
    until = main_run["stopped_sending_s"] - 1.0
    later = [s for s in main_run["samples"] if warm_s <= s["t"] <= until]
    if not later:
        raise RuntimeError("the soak ended before the warm-up did; give more requests")
    baseline, samples = later[0], later[1:]
    final = main_run["server"]["after"]  # after the load generator has gone: its connections closed
    print(f"baseline after warm-up (at {baseline['t']:.0f} s): RSS {baseline['rss_mb']} MB, {baseline['threads']} "
          f"threads, {baseline['fds']} fds", file=sys.stderr)
    rss = [s["rss_mb"] for s in samples] + [baseline["rss_mb"]]
    threads = sorted({s["threads"] for s in samples} | {baseline["threads"]})
    fds = sorted({s["fds"] for s in samples} | {baseline["fds"]})
    growth_end = round(samples[-1]["rss_mb"] - baseline["rss_mb"], 1) if samples else 0.0
    statuses = {int(k): v for k, v in main_run["statuses"].items()}
    server_errors = sum(n for code, n in statuses.items() if code >= 500)
    growth_peak = round(max(rss) - baseline["rss_mb"], 1)
    checks = [
        {"check": f"RSS growth after warm-up < {GROWTH_LIMIT_MB:g} MB", "passed": max(growth_end, growth_peak)
         < GROWTH_LIMIT_MB, "detail": f"{baseline['rss_mb']} -> {rss[-2] if samples else rss[-1]} MB at the end "
                                      f"({growth_end:+} MB), peak {max(rss)} MB ({growth_peak:+} MB)"},
        {"check": "constant thread count", "passed": threads == [baseline["threads"]],
         "detail": f"baseline {baseline['threads']}, seen {threads}"},
        {"check": "constant descriptor count", "passed": fds == [baseline["fds"]],
         "detail": f"baseline {baseline['fds']}, seen {fds}"},
        {"check": "zero 5xx", "passed": server_errors == 0, "detail": f"statuses {main_run['statuses']}"},
        {"check": "no connection failures", "passed": main_run["error_total"] == 0,
         "detail": f"{main_run['errors']}"},
    ]
    return {
        "model": settings["model"], "fraction": round(rate / capacity["ok_per_s"], 3), "settings": settings, "requests": total,
        "warmup_requests": warmup,
        "capacity_per_s": capacity["ok_per_s"], "rate": round(rate, 2), "connections": connections,
        "achieved_per_s": main_run["requests_per_s"], "late_sends": main_run["late_sends"],
        "latency_ms": main_run["latency_ms"], "statuses": main_run["statuses"], "errors": main_run["errors"],
        "rss_mb_before_warmup": main_run["server"]["before"]["rss_mb"],
        "baseline": baseline, "final": final, "rss_growth_mb": growth_end, "rss_peak_growth_mb": growth_peak,
        "threads_seen": threads, "fds_seen": fds, "elapsed_s": main_run["elapsed_s"],
        "load_average": main_run["load_average"], "samples": samples, "checks": checks,
    }


def print_figures(result: dict) -> None:
    lat = result["latency_ms"]
    print(f"\n{result['warmup_requests']} warm-up + {result['requests']} requests at {result['achieved_per_s']:.2f}/s "
          f"(target {result['rate']:.2f}/s = {result['fraction']:.0%} of {result['capacity_per_s']:.2f}/s) in "
          f"{result['elapsed_s']:.0f} s: {result['statuses']}; p50/p90/p99 {lat['p50']}/{lat['p90']}/{lat['p99']} ms; "
          f"load average {result['load_average']}", file=sys.stderr)
    print(f"RSS {result['rss_mb_before_warmup']} MB before warm-up, {result['baseline']['rss_mb']} MB after -> "
          f"{result['baseline']['rss_mb'] + result['rss_growth_mb']:.1f} MB at the end "
          f"({result['rss_growth_mb']:+} MB; peak {result['rss_peak_growth_mb']:+} MB); threads "
          f"{result['threads_seen']}; fds {result['fds_seen']}", file=sys.stderr)
    for check in result["checks"]:
        print(f"  {'PASS' if check['passed'] else 'FAIL'}  {check['check']}: {check['detail']}", file=sys.stderr)
    passed = all(check["passed"] for check in result["checks"])
    print(f"verdict: {'PASS' if passed else 'FAIL'}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
