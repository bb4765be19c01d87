"""Compare two checkouts of the service side by side: both up at once, driven in turn by the same load.

A shared machine's speed drifts by 10 to 20% from one minute to the next, more than most changes
are worth, so two whole `scripts/bench` runs taken one after the other can mislead. This starts a
server from each checkout (`python -m app serve` in that folder, on the same model and the same
generated 640x480 JPEG scenes), waits until both are ready, and then, for each connection count,
drives them in ABBA order, `--pairs` times, with `tools/loadgen.py`: each step is a fresh
closed-loop load of `--duration` seconds against one server while the other idles. For each step it
reports images/s and the CPU time per image of that server's whole process tree (the HTTP process
and its model workers, from /proc), and per pair the ratio B / A.

    .venv/bin/python -m tools.ab --a ../before --b . [--model models/shapes] [--connections 1,64]
        [--pairs 3] [--duration 15] [--protocol detect|v2-binary|grpc] [--out out/ab.json]

`--protocol` chooses what the load sends: POST /detect (the default), KServe v2 over HTTP with the images as
binary BYTES, or KServe v2's gRPC ModelInfer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tools import ROOT, loadgen
from tools.images import make_images
from tools.server import ServerProcess


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(checkout: Path, model: Path, log: Path, grpc: bool = False) -> ServerProcess:
    """Start `python -m app serve` in `checkout` on `model` alone; return it once /readyz answers 200.

    Readiness is polled over HTTP, not read from the notify descriptor that ServerProcess.start uses, since
    a checkout from before that descriptor existed must start too.
    """
    port = free_port()
    grpc_port = free_port() if grpc else None
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    env.update(DETECT_PORT=str(port), DETECT_GRPC_PORT=str(grpc_port) if grpc else "off", DETECT_MODEL=str(model),
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(checkout))
    with log.open("wb") as handle:
        process = subprocess.Popen([sys.executable, "-m", "app", "serve"], cwd=checkout, env=env,
                                   stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = ServerProcess(process, port, log, grpc_port)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server in {checkout} exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
                if answer.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.5)
    server.stop()
    raise SystemExit(f"the server in {checkout} was not ready in 300 s; see {log}")


def step(server: ServerProcess, images: Path, connections: int, duration_s: float, out: Path,
         protocol: str = "detect", model: str = "") -> dict:
    before = server.stats()["cpu_s"]  # the HTTP process and its workers, from /proc
    if protocol == "grpc":
        load = loadgen.spawn(server.grpc_port, images, out, connections, duration_s, grpc_model=model)
    elif protocol == "v2-binary":
        load = loadgen.spawn(server.port, images, out, connections, duration_s, v2_model=model)
    else:
        load = loadgen.spawn(server.port, images, out, connections, duration_s)
    summary = loadgen.collect(load, out, duration_s + 120)
    cpu = server.stats()["cpu_s"] - before
    answered = summary["requests"] - summary["error_total"]
    return {"images_per_s": summary["ok_per_s"], "errors": summary["error_total"],
            "p50_ms": summary["latency_ms"]["p50"],
            "cpu_ms_per_image": round(1000 * cpu / answered, 2) if answered else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ab", description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="the first checkout (e.g. the commit before a change)")
    parser.add_argument("--b", type=Path, required=True, help="the second checkout (e.g. this one)")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "shapes", help="model base path")
    parser.add_argument("--connections", default="1,64", help="comma-separated connection counts")
    parser.add_argument("--pairs", type=int, default=3, help="ABBA pairs per connection count")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per step")
    parser.add_argument("--protocol", choices=("detect", "v2-binary", "grpc"), default="detect",
                        help="what the load sends (default: POST /detect)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "ab.json")
    args = parser.parse_args(argv)
    model_name = args.model.resolve().name
    counts = [int(c) for c in args.connections.split(",") if c.strip()]
    with tempfile.TemporaryDirectory() as scratch_text:
        scratch = Path(scratch_text)
        images = make_images(scratch / "images")
        servers = {}
        try:
            for name, checkout in (("a", args.a), ("b", args.b)):
                servers[name] = start(checkout.resolve(), args.model.resolve(), scratch / f"server-{name}.log",
                                      grpc=args.protocol == "grpc")
                print(f"{name}: {checkout} on port {servers[name].port}", flush=True)
            for server in servers.values():  # warm both: first calls are slow
                step(server, images, 4, 3, scratch / "warm.json", args.protocol, model_name)
            result = {"a": str(args.a), "b": str(args.b), "model": str(args.model), "duration_s": args.duration,
                      "protocol": args.protocol,
                      "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "steps": {}}
            for connections in counts:
                rows = []
                for pair in range(args.pairs):
                    order = ("a", "b") if pair % 2 == 0 else ("b", "a")
                    figures = {}
                    for name in order:
                        figures[name] = step(servers[name], images, connections, args.duration,
                                             scratch / "step.json", args.protocol, model_name)
                    ratio = round(figures["b"]["images_per_s"] / figures["a"]["images_per_s"], 3)
                    rows.append({"order": "".join(order), **figures, "b_over_a": ratio})
                    print(f"{connections:>4} connections, pair {pair + 1} ({' then '.join(order)}): "
                          + " | ".join(f"{n} {figures[n]['images_per_s']:7.2f} img/s, p50 {figures[n]['p50_ms']} ms, "
                                       f"{figures[n]['cpu_ms_per_image']} ms CPU/img" for n in ("a", "b"))
                          + f" | b/a {ratio:.3f}", flush=True)
                ratios = [r["b_over_a"] for r in rows]
                result["steps"][str(connections)] = {"pairs": rows, "b_over_a_median": statistics.median(ratios),
                                                     "b_over_a_range": [min(ratios), max(ratios)]}
                print(f"{connections:>4} connections: b/a median {statistics.median(ratios):.3f} "
                      f"(from {min(ratios):.3f} to {max(ratios):.3f})", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
