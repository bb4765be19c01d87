"""Measure what this service adds to one image's time: requests to it and in-process calls, by turns.

A table of the peer benchmark times the in-process single image and the service's one-connection step a
minute or more apart, and this shared machine's speed drifts by more than the gap between them. Here the
two alternate in blocks, so the drift touches both alike:

- a block of `--per-block` requests to the service, one after another on one keep-alive connection,
  `POST /detect?timing=stages` (the server's stages: `timing_ms.stages`), each timed by the client;
- a block of as many in-process calls on the same images, in this process: decoding as the server decodes
  (its allocator and Pillow settings, at the model's working size) and the model at batch 1.

The service runs from `--service-root` with `spare_workers` as given (0 by default, so nothing else
holds a core) and gRPC off. Writes overhead.json and overhead.md: the p50 of every stage, of the
client's round trip and of the in-process decode, call and both; the service's overhead is the round
trip's p50 less the in-process decode and call's.

    .venv/bin/python -m benchmarks.overhead [--model models/objects] [--images auto|scenes|photos]
        [--blocks 10] [--per-block 20] [--spares 0] [--out out/overhead]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.peers import proctree, systems
from benchmarks.peers.compare import photo_images, wait_ready
from tools import ROOT
from tools.images import make_images
from tools.loadgen import read_bodies
from tools.samplers import load_average


class InProcess:
    """The model in this process, with the server's decoding."""

    def __init__(self, model: Path):
        from app.inference.detector import load_detector
        from app.inference.images import decode_image
        from app.inference.working_size import read_working_size
        from app.process import configure_allocator, configure_pillow
        from app.settings import Settings

        configure_pillow()
        configure_allocator()
        self._decode_image = decode_image
        self._max_pixels = Settings().max_image_pixels
        self._detector = load_detector(model)
        self._detector.warm_up()
        self._working = read_working_size(self._detector.model.path)

    def run(self, jpeg: bytes) -> tuple[float, float]:
        """Decode and run one image; return the seconds of each."""
        started = time.perf_counter()
        pixels = self._decode_image(jpeg, self._max_pixels, self._working).pixels[None]
        decoded = time.perf_counter()
        self._detector.run(pixels)
        return decoded - started, time.perf_counter() - decoded


def ask(connection: http.client.HTTPConnection, jpeg: bytes) -> tuple[float, dict]:
    """POST one image; return the client's round trip in seconds and the server's stages in ms."""
    started = time.perf_counter()
    connection.request("POST", "/detect?timing=stages", body=jpeg, headers={"Content-Type": "image/jpeg"})
    answer = connection.getresponse()
    body = answer.read()
    took = time.perf_counter() - started
    if answer.status != 200:
        raise RuntimeError(f"the service answered {answer.status}: {body[:300]!r}")
    return took, json.loads(body)["timing_ms"]["stages"]


def p50_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1000, 2)


def measure(args, jpegs: list[bytes], work: Path) -> dict:
    """Start the service as the peer benchmark does (gRPC off), then time it and the model in process by turns."""
    in_process = InProcess(args.model)
    system = replace(systems.SYSTEMS["service-no-spare"], spare_workers=args.spares)
    how = systems.launch(system, args.model, args.service_root, work, work)  # no peer: no venv is used
    with (work / "server.log").open("wb") as handle:
        process = subprocess.Popen(how.command, cwd=how.cwd, env=how.env, stdout=handle, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    seen: dict[int, int] = {}
    result: dict = {"load_average": {"before": load_average()}}
    try:
        wait_ready(how, process, system, jpegs[0])
        seen.update(proctree.identities(proctree.tree(process.pid)))
        connection = http.client.HTTPConnection("127.0.0.1", how.port, timeout=60)
        for i in range(args.per_block):  # warm both: the first calls of each are slow
            ask(connection, jpegs[i % len(jpegs)])
            in_process.run(jpegs[i % len(jpegs)])
        round_trips, stages, decodes, calls, totals = [], {}, [], [], []
        for block in range(args.blocks):
            for i in range(args.per_block):
                took, timeline = ask(connection, jpegs[i % len(jpegs)])
                round_trips.append(took)
                for stage, ms in timeline.items():
                    stages.setdefault(stage, []).append(ms / 1000)
            for i in range(args.per_block):
                decode_s, call_s = in_process.run(jpegs[i % len(jpegs)])
                decodes.append(decode_s)
                calls.append(call_s)
                totals.append(decode_s + call_s)
            print(f"[{time.strftime('%H:%M:%S')}] block {block + 1}/{args.blocks}: service p50 "
                  f"{p50_ms(round_trips)} ms, in process {p50_ms(totals)} ms", file=sys.stderr, flush=True)
        connection.close()
        result.update(
            requests=len(round_trips),
            stages_ms_p50={stage: p50_ms(values) for stage, values in stages.items()},
            round_trip_ms_p50=p50_ms(round_trips),
            in_process_ms_p50={"decode": p50_ms(decodes), "call": p50_ms(calls), "total": p50_ms(totals)})
        result["overhead_ms"] = round(result["round_trip_ms_p50"] - result["in_process_ms_p50"]["total"], 2)
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        result["stop"] = proctree.stop_started(process, seen)
        result["load_average"]["after"] = load_average()
    return result


def table(result: dict) -> str:
    if result.get("error"):
        return f"failed: {result['error']}\n"
    inside = result["in_process_ms_p50"]
    lines = ["| | p50 (ms) |", "|---|---|"]
    lines += [f"| server stage: {stage} | {ms} |" for stage, ms in result["stages_ms_p50"].items()]
    lines += [f"| **client's round trip** | **{result['round_trip_ms_p50']}** |",
              f"| in process: decode | {inside['decode']} |",
              f"| in process: model call | {inside['call']} |",
              f"| **in process: decode and call** | **{inside['total']}** |",
              f"| **the service adds** | **{result['overhead_ms']}** |"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "objects", help="model base path")
    parser.add_argument("--images", choices=("auto", "scenes", "photos"), default="auto",
                        help="generated scenes of shapes, or the peer benchmark's photos (auto: scenes for the "
                             "shapes model, else photos)")
    parser.add_argument("--blocks", type=int, default=10, help="blocks of each, by turns")
    parser.add_argument("--per-block", type=int, default=20, help="requests, and in-process calls, per block")
    parser.add_argument("--spares", type=int, default=0, help="the service's spare_workers")
    parser.add_argument("--service-root", type=Path, default=ROOT, help="the checkout to run (default: this one)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "overhead")
    args = parser.parse_args(argv)
    args.model, args.service_root = args.model.resolve(), args.service_root.resolve()
    if args.images == "auto":
        args.images = "scenes" if args.model.name == "shapes" else "photos"
    args.out.mkdir(parents=True, exist_ok=True)
    folder = make_images(args.out / "images") if args.images == "scenes" else photo_images(args.out / "photos")
    jpegs = [body for body, _ in read_bodies(folder)]
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
              "model": str(args.model), "images": args.images, "blocks": args.blocks, "per_block": args.per_block,
              "spare_workers": args.spares,
              "command": "benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    result.update(measure(args, jpegs, args.out))
    (args.out / "overhead.json").write_text(json.dumps(result, indent=1))
    (args.out / "overhead.md").write_text(table(result))
    print(table(result))
    return 1 if result.get("error") or result["stop"]["left"] else 0


if __name__ == "__main__":
    sys.exit(main())
