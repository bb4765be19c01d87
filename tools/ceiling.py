"""The in-process ceiling: decoding plus the model on the same images, no HTTP, in a child of its own.

`python -m tools.ceiling` is that child (run by run_ceiling, so that the caller never hosts TensorFlow);
bench and the peer comparison set the service's figures against it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tools import ROOT, loadgen


def measure_ceiling(model: Path, images: Path, batch_sizes: tuple[int, ...], seconds: float,
                    thread_counts: tuple[int, ...] = (1,), decode_at_model_size: bool = True) -> dict:
    """Time decoding plus the model on the images, no HTTP; return figures per batch size and thread count.

    With T threads, each thread decodes a batch and runs it, so one thread's decoding overlaps another's
    model call, as the server's request threads and inference threads overlap; the best of every
    (batch, threads) pair is the ceiling.
    """
    import itertools

    import numpy as np

    from app.inference.detector import load_detector
    from app.inference.images import decode_image
    from app.settings import Settings
    from app.inference.working_size import read_working_size
    from app.process import configure_allocator, configure_pillow

    configure_pillow()
    configure_allocator()  # the server's allocator settings, so its decoding is timed as the server decodes
    max_pixels = Settings().max_image_pixels
    blobs = [body for body, _ in loadgen.read_bodies(images)]
    detector = load_detector(model)
    detector.warm_up()
    working = read_working_size(detector.model.path) if decode_at_model_size else None

    def decode(data: bytes):
        """Decode as the server does: at the model's working size unless decode_at_model_size is off."""
        return decode_image(data, max_pixels, working)

    def timed(fn, at_least: int = 3) -> list[float]:
        times = []
        stop = time.perf_counter() + seconds
        while len(times) < at_least or time.perf_counter() < stop:
            started = time.perf_counter()
            fn(len(times))
            times.append(time.perf_counter() - started)
        return times

    def decoded(start: int, size: int) -> np.ndarray:
        pixels = [decode(blobs[(start + j) % len(blobs)]).pixels for j in range(size)]
        return np.stack(pixels) if size > 1 else pixels[0][None]

    decode_s = timed(lambda i: decode(blobs[i % len(blobs)]), at_least=len(blobs))
    single_s = timed(lambda i: detector.run(decoded(i, 1)), at_least=5)
    per_run = {}
    limit = detector.max_batch
    for threads, size in itertools.product(thread_counts, batch_sizes):
        if limit is not None and size > limit:
            continue
        detector.run(decoded(0, size))
        calls: list[float] = []
        model_s: list[float] = []
        batches = itertools.count()  # next() on a count is atomic in CPython

        def worker() -> None:
            mine = 0
            stop = time.perf_counter() + seconds
            while mine < 3 or time.perf_counter() < stop:
                started = time.perf_counter()
                batch = decoded(next(batches) * size, size)
                model_started = time.perf_counter()
                detector.run(batch)
                done = time.perf_counter()
                model_s.append(done - model_started)
                calls.append(done - started)
                mine += 1

        wall_started, cpu_started = time.perf_counter(), time.process_time()
        workers = [threading.Thread(target=worker, name=f"ceiling-{i}") for i in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        wall, cpu = time.perf_counter() - wall_started, time.process_time() - cpu_started
        key = str(size) if threads == 1 else f"{size}x{threads}"
        per_run[key] = {
            "batch": size,
            "threads": threads,
            "calls": len(calls),
            "images_per_s": round(size * len(calls) / wall, 2),
            "call_ms_p50": round(1000 * loadgen.percentile(calls, 50), 2),
            "model_ms_p50": round(1000 * loadgen.percentile(model_s, 50), 2),
            "model_images_per_s": round(threads * size * len(model_s) / sum(model_s), 2),
            "images_per_cpu_s": round(size * len(calls) / cpu, 2),  # whatever CPU the shared machine gave
            "cpu_percent": round(100 * cpu / wall, 1),
        }
        figures = per_run[key]
        print(f"  ceiling: batch {size:3d}, {threads} thread{'s' if threads > 1 else ' '}: "
              f"{figures['images_per_s']:8.2f} images/s (model calls {figures['model_ms_p50']:.1f} ms p50; "
              f"{figures['images_per_cpu_s']:.2f} per CPU-second at {figures['cpu_percent']:.0f}% CPU)",
              file=sys.stderr, flush=True)
    # The single image again, after the batches: a first pass slowed by whatever else the shared machine
    # was doing would make the goals' reference too easy to meet, so the faster of the two passes counts.
    single_again_s = timed(lambda i: detector.run(decoded(i, 1)), at_least=5)
    single_p50 = min(loadgen.percentile(single_s, 50), loadgen.percentile(single_again_s, 50))
    best = max(per_run, key=lambda k: per_run[k]["images_per_s"])
    return {
        "model": str(model), "model_max_batch": limit, "working_size": working.describe() if working else None,
        "decode_ms_p50": round(1000 * loadgen.percentile(decode_s, 50), 2),
        "single_image_ms_p50": round(1000 * single_p50, 2),  # decode + batch-1 call, the faster of two passes
        "per_batch": per_run,
        "best_batch": per_run[best]["batch"],
        "best_threads": per_run[best]["threads"],
        "images_per_s": per_run[best]["images_per_s"],
        "images_per_cpu_s": per_run[best]["images_per_cpu_s"],
    }


def run_ceiling(model: Path, images: Path, out: Path, batch_sizes, seconds: float, thread_counts,
                decode_at_model_size: bool = True) -> dict:
    """Measure the ceiling in a child process (so the caller never hosts TensorFlow); return its figures."""
    args = [sys.executable, "-m", "tools.ceiling", "--model", str(model), "--images", str(images),
            "--json", str(out), "--seconds", f"{seconds:g}", "--batches", ",".join(str(b) for b in batch_sizes),
            "--threads", ",".join(str(t) for t in thread_counts)]
    if not decode_at_model_size:
        args.append("--full-size")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    code = subprocess.run(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL).returncode
    if code != 0:
        raise RuntimeError(f"the ceiling measurement exited with status {code}")
    return json.loads(out.read_text())


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in text.split(","))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ceiling", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="model base path")
    parser.add_argument("--images", type=Path, required=True, help="folder of .jpg/.jpeg/.png files")
    parser.add_argument("--json", type=Path, required=True, help="where to write the figures")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per batch size and thread count")
    parser.add_argument("--batches", type=_int_list, default=(1,), help="comma-separated batch sizes")
    parser.add_argument("--threads", type=_int_list, default=(1,), help="comma-separated thread counts")
    parser.add_argument("--full-size", action="store_true", help="decode at full size, not the working size")
    args = parser.parse_args(argv)
    result = measure_ceiling(args.model, args.images, args.batches, args.seconds, args.threads, not args.full_size)
    args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
