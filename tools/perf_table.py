"""`python -m tools.perf_table`: perf_analyzer's own figures for the service, side by side in one run.

One server (the objects model by default, no spare worker) on free HTTP and gRPC ports; Triton's
perf_analyzer 2.60 (tools/clients.py) in Triton mode over HTTP, gRPC, gRPC streaming, and system shared
memory over both, at each concurrency, on one photo's pixels at the given size. Prints a Markdown table:
throughput, p50 and p99 latency as perf_analyzer measured them, and the server's own split of a request
(queue, compute input, infer, output) that perf_analyzer reads from the statistics extension.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools import ROOT
from tools.clients import perf_analyzer_command
from tools.server import ServerProcess, write_settings

MODES = {  # name -> perf_analyzer's arguments beyond the URL
    "HTTP": ["-i", "http"],
    "gRPC": ["-i", "grpc"],
    "gRPC streaming": ["-i", "grpc", "--streaming"],
    "HTTP, system shared memory": ["-i", "http", "--shared-memory", "system"],
    "gRPC, system shared memory": ["-i", "grpc", "--shared-memory", "system"],
}
COLUMNS = ("Server Queue", "Server Compute Input", "Server Compute Infer", "Server Compute Output")


def photo_pixels(width: int, height: int) -> np.ndarray:
    """A photo from samples/ (NASA's astronaut, public domain), resized to width x height, as uint8 RGB."""
    from PIL import Image

    with Image.open(ROOT / "samples" / "astronaut.jpg") as photo:
        return np.asarray(photo.convert("RGB").resize((width, height), Image.BILINEAR), dtype=np.uint8)


def measure(argv: list[str], model: str, url: str, mode: list[str], concurrency: int, data: Path, window_ms: int,
            report: Path) -> dict:
    """One perf_analyzer run; return its CSV row (microseconds) for the concurrency."""
    # Time windows of `window_ms`, at most three, the last one reported: a 2-core machine shared with the client
    # rarely holds perf_analyzer's default 10 % stability, so any spread is accepted rather than no report.
    command = [*argv, "-m", model, "-u", url, *mode, "--concurrency-range", str(concurrency),
               "--measurement-interval", str(window_ms), "--stability-percentage", "999", "--max-trials", "3",
               "--input-data", str(data), "-f", str(report)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"perf_analyzer {' '.join(mode)} at {concurrency}: exited {done.returncode}\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    with report.open() as handle:
        (row,) = list(csv.DictReader(handle))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="objects", help="a model folder under models/ (default: objects)")
    parser.add_argument("--size", default="640x480", help="the photo's size, WIDTHxHEIGHT (default: 640x480)")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated (default: 1,4,16)")
    parser.add_argument("--window-ms", type=int, default=5000, help="each measurement window (default: 5000)")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))
    levels = [int(c) for c in args.concurrency.split(",")]
    perf_analyzer = perf_analyzer_command()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        pixels = photo_pixels(width, height)
        data = folder / "photo.json"
        data.write_text(json.dumps({"data": [{"input_tensor": {"content": pixels.ravel().tolist(),
                                                               "shape": list(pixels.shape)}}]}))
        config = folder / "settings.toml"
        write_settings(config, {"model": str(ROOT / "models" / args.model), "spare_workers": 0, "grpc_port": 0})
        server = ServerProcess.start(config, folder / "server.log")
        try:
            name = Path(args.model).name
            print(f"perf_analyzer 2.60, model {name}, {width}x{height} pixels, server pid {server.pid}; "
                  f"{time.strftime('%Y-%m-%d %H:%M %Z')}", file=sys.stderr)
            rows = []
            for mode, mode_args in MODES.items():
                port = server.port if mode.startswith("HTTP") else server.grpc_port
                for concurrency in levels:
                    row = measure(perf_analyzer, name, f"127.0.0.1:{port}", mode_args, concurrency, data,
                                  args.window_ms, folder / "report.csv")
                    rows.append((mode, concurrency, row))
                    print(f"{mode} at {concurrency}: {float(row['Inferences/Second']):.2f} infer/s", file=sys.stderr)
        finally:
            server.stop()
    print("| mode | concurrency | infer/s | p50 ms | p99 ms | queue ms | compute input ms | infer ms | output ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, concurrency, row in rows:
        split = " | ".join(f"{int(row[c]) / 1000:.2f}" if c in row else "-" for c in COLUMNS)
        print(f"| {mode} | {concurrency} | {float(row['Inferences/Second']):.2f} | {int(row['p50 latency']) / 1000:.1f} | "
              f"{int(row['p99 latency']) / 1000:.1f} | {split} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
