"""Time one image through KServe v2 with tritonclient, three ways: the file as a binary BYTES input, the
pixels as binary UINT8, and the pixels as JSON `data`; one connection, the client's encoding included.

Usage: .venv/bin/python -m tools.v2_payloads [--model DIR] [--requests 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tools import ROOT
from tools.images import make_images
from tools.server import ServerProcess, write_settings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.v2_payloads", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "shapes")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "v2_payloads")
    args = parser.parse_args(argv)
    import tritonclient.http as triton
    from PIL import Image

    model = args.model.resolve()
    name = model.parent.name if model.name.isdigit() else model.name
    images = make_images(args.out / "images", count=1)
    jpeg = sorted(images.glob("*.jpg"))[0]
    blob, pixels = jpeg.read_bytes(), np.asarray(Image.open(jpeg).convert("RGB"))[None]
    config = args.out / "server.toml"
    write_settings(config, {"model": str(model), "log_level": "WARNING"})
    server = ServerProcess.start(config, args.out / "server.log")
    try:
        client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
        for kind in ("file as binary BYTES", "pixels as binary UINT8", "pixels as JSON data"):
            times = []
            for i in range(args.requests + 3):  # three to warm up
                if kind.startswith("file"):
                    tensor = triton.InferInput("image", [1], "BYTES")
                    tensor.set_data_from_numpy(np.array([blob], dtype=object))
                else:
                    tensor = triton.InferInput("input_tensor", list(pixels.shape), "UINT8")
                    tensor.set_data_from_numpy(pixels, binary_data="binary" in kind)
                started = time.perf_counter()
                client.infer(name, [tensor], outputs=[triton.InferRequestedOutput("num_detections")])
                if i >= 3:
                    times.append(time.perf_counter() - started)
            print(f"{kind}: p50 {statistics.median(times) * 1000:.1f} ms over {len(times)} requests")
        client.close()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
