"""What drawing and video cost, each side by side with what it replaces, on one server.

1. Rendering: POST /detect answered as JSON against the same 640x480 JPEG scenes answered with their boxes
   drawn (format=jpeg), at 1 and 64 connections, in ABBA order (tools/loadgen.py): images/s and the CPU time
   per image of the server's processes (/proc). The goal: the picture costs at most 15% more.
2. Video: frames per second through /detect/video against the same frames posted one by one as JPEGs at the
   concurrency that saturates the model, in ABBA order. The frames are a generated sequence (tools/sequences.py:
   shapes moving, 640x480, 30 fps) encoded once as an MP4 and once as JPEGs (quality 90). The goal: 0.9x or more.

    .venv/bin/python -m tools.vision_bench [--model models/shapes] [--pairs 3] [--duration 15]
        [--connections 1,64] [--jpeg-connections 32] [--videos 1,4] [--out out/vision_bench.json]

Run it under `flock /tmp/bench.lock` on a shared machine: both sides of each comparison run in turn on the same
server, so what else the machine does weighs on both alike.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from tools import ROOT, loadgen
from tools.images import make_images
from tools.sequences import shapes_sequence, write_video
from tools.server import ServerProcess, write_settings


def start(model: Path, scratch: Path) -> ServerProcess:
    config = scratch / "server.toml"
    write_settings(config, {"model": str(model), "spare_workers": 0, "idle_unload_s": 0.0,
                            "max_video_bytes": "512MiB", "max_video_frames": 100000})
    return ServerProcess.start(config, scratch / "server.log")


def image_step(server: ServerProcess, images: Path, connections: int, duration_s: float, path: str,
               scratch: Path) -> dict:
    """A closed-loop load of POSTs of `images` to `path`; images/s and CPU ms per image of the server."""
    before = server.stats()["cpu_s"]
    out = scratch / "step.json"
    load = loadgen.spawn(server.port, images, out, connections, duration_s, path=path)
    summary = loadgen.collect(load, out, duration_s + 120)
    cpu = server.stats()["cpu_s"] - before
    answered = summary["requests"] - summary["error_total"]
    return {"per_s": summary["ok_per_s"], "errors": summary["error_total"], "p50_ms": summary["latency_ms"]["p50"],
            "cpu_ms_per_image": round(1000 * cpu / answered, 2) if answered else None}


def video_step(server: ServerProcess, video: bytes, streams: int, duration_s: float, model: str) -> dict:
    """`streams` clients each posting the video to /detect/video again and again for `duration_s`: frames/s
    answered (whole videos and the frames of the last ones cut by the end alike) and CPU ms per frame."""
    frames = [0] * streams
    errors = [0] * streams
    stop_at = time.monotonic() + duration_s

    def client(index: int) -> None:
        while time.monotonic() < stop_at:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
            try:
                conn.request("POST", f"/models/{model}/detect/video", video, {"Content-Type": "video/mp4"})
                answer = conn.getresponse()
                if answer.status != 200:
                    errors[index] += 1
                    answer.read()
                    continue
                while time.monotonic() < stop_at:
                    line = answer.readline()
                    if not line:
                        break
                    if line.startswith(b'{"frame"'):
                        frames[index] += 1
                    elif line.startswith(b'{"error"'):
                        errors[index] += 1
            finally:
                conn.close()

    before = server.stats()["cpu_s"]
    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    cpu = server.stats()["cpu_s"] - before
    total = sum(frames)
    return {"per_s": round(total / elapsed, 2), "errors": sum(errors),
            "cpu_ms_per_image": round(1000 * cpu / total, 2) if total else None}


def abba(name: str, sides: dict, pairs: int) -> dict:
    """Run two sides (name -> step function) in ABBA order; return each step and the ratio b / a per pair."""
    (a, run_a), (b, run_b) = sides.items()
    rows = []
    for pair in range(pairs):
        order = ((a, run_a), (b, run_b)) if pair % 2 == 0 else ((b, run_b), (a, run_a))
        figures = {side: run() for side, run in order}
        ratio = round(figures[b]["per_s"] / figures[a]["per_s"], 3) if figures[a]["per_s"] else None
        cpu_ratio = (round(figures[b]["cpu_ms_per_image"] / figures[a]["cpu_ms_per_image"], 3)
                     if figures[a]["cpu_ms_per_image"] and figures[b]["cpu_ms_per_image"] else None)
        rows.append({"order": f"{order[0][0]} then {order[1][0]}", **figures, "b_over_a": ratio,
                     "cpu_b_over_a": cpu_ratio})
        print(f"{name}, pair {pair + 1}: " + " | ".join(
            f"{side} {figures[side]['per_s']:.2f}/s, {figures[side]['cpu_ms_per_image']} ms CPU each"
            for side in (a, b)) + f" | {b}/{a} {ratio} (CPU {cpu_ratio})", flush=True)
    ratios = [r["b_over_a"] for r in rows if r["b_over_a"] is not None]
    cpu = [r["cpu_b_over_a"] for r in rows if r["cpu_b_over_a"] is not None]
    summary = {"a": a, "b": b, "pairs": rows, "b_over_a_median": statistics.median(ratios) if ratios else None,
               "b_over_a_range": [min(ratios), max(ratios)] if ratios else None,
               "cpu_b_over_a_median": statistics.median(cpu) if cpu else None}
    print(f"{name}: {b}/{a} median {summary['b_over_a_median']} (range {summary['b_over_a_range']}), CPU per image "
          f"{summary['cpu_b_over_a_median']}", flush=True)
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.vision_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "shapes")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per step")
    parser.add_argument("--connections", default="1,64", help="connection counts of the rendering comparison")
    parser.add_argument("--jpeg-connections", type=int, default=32,
                        help="connections posting JPEGs in the video comparison (enough to saturate the model)")
    parser.add_argument("--videos", default="1,4", help="video streams at once in the video comparison")
    parser.add_argument("--frames", type=int, default=300, help="frames of the generated video")
    parser.add_argument("--skip", choices=("render", "video"), default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "vision_bench.json")
    args = parser.parse_args(argv)
    from PIL import Image

    model = args.model.resolve().name
    result = {"model": model, "duration_s": args.duration, "cpus": os.cpu_count(),
              "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory() as scratch_text:
        scratch = Path(scratch_text)
        images = make_images(scratch / "images")
        sequence = shapes_sequence(seed=1, frames=args.frames, size=(640, 480))
        video = write_video(sequence, scratch / "video.mp4").read_bytes()
        frames = scratch / "frames"
        frames.mkdir()
        for index, pixels in enumerate(sequence.frames):
            Image.fromarray(pixels).save(frames / f"frame-{index:04d}.jpg", quality=90)
        server = start(args.model.resolve(), scratch)
        try:
            image_step(server, images, 8, 5, "/detect?format=jpeg", scratch)  # warm both paths and the batcher
            video_step(server, video, 1, 5, model)
            if args.skip != "render":
                result["render"] = {}
                for connections in [int(c) for c in args.connections.split(",")]:
                    result["render"][str(connections)] = abba(f"render, {connections} connection(s)", {
                        "json": lambda c=connections: image_step(server, images, c, args.duration, "/detect", scratch),
                        "jpeg": lambda c=connections: image_step(server, images, c, args.duration,
                                                                 "/detect?format=jpeg", scratch),
                    }, args.pairs)
            if args.skip != "video":
                result["video"] = {"frames": args.frames, "size": [640, 480], "jpeg_connections": args.jpeg_connections}
                for streams in [int(v) for v in args.videos.split(",")]:
                    result["video"][str(streams)] = abba(f"video, {streams} stream(s)", {
                        "jpegs": lambda: image_step(server, frames, args.jpeg_connections, args.duration,
                                                    f"/models/{model}/detect", scratch),
                        "video": lambda s=streams: video_step(server, video, s, args.duration, model),
                    }, args.pairs)
        finally:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
