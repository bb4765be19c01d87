"""Generated video sequences whose every object's box is known, frame by frame.

- `shapes_sequence`: circles, squares, triangles and stars of the `shapes` model gliding over a textured
  background at their own speeds, bouncing off the edges, crossing and hiding one another (a fixed depth
  order: the later shape passes in front).
- `pan_sequence`: a slow pan and zoom across a committed photo (samples/astronaut.jpg for `objects`): the
  person's box in the photo, carried through each frame's crop and zoom, is the one truth.

Each is a pure function of its arguments. They feed tools/track_quality.py (MOTA, IDF1), the video tests,
the committed samples (samples/shapes.mp4 and samples/pan.mp4, `python -m tools.sequences --samples`), and
the page test's fake camera (`write_y4m`, the format Chromium's --use-file-for-fake-video-capture reads).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Optional

import numpy as np
from PIL import Image, ImageDraw

from tools import ROOT

CLASSES = {"circle": 1, "square": 2, "triangle": 3, "star": 4}  # the shapes model's class ids
MIN_VISIBLE = 0.4  # an object less visible than this is not in the truth (the model learnt shapes 60% in view)
# The person's box in samples/astronaut.jpg (512 x 512), as objects finds it on the whole photo.
ASTRONAUT_PERSON = (14.7, 14.4, 363.9, 508.1)


@dataclass(frozen=True)
class Truth:
    """One object in one frame: its identity, class, box (x_min, y_min, x_max, y_max) and how much of it shows."""

    object_id: int
    class_id: int
    box: tuple[float, float, float, float]
    visible: float  # share of its own pixels that nothing in front of it hides (and, in a pan, inside the frame)


@dataclass
class Sequence:
    """A generated video: its frames (RGB uint8), its rate, and the truth of every frame."""

    name: str
    fps: float
    frames: list[np.ndarray] = field(default_factory=list)
    truth: list[list[Truth]] = field(default_factory=list)

    @property
    def size(self) -> tuple[int, int]:
        height, width = self.frames[0].shape[:2]
        return width, height


@dataclass
class _Mover:
    object_id: int
    class_id: int
    radius: float
    angle: float
    colour: tuple[int, int, int]
    x: float
    y: float
    vx: float
    vy: float


def shapes_sequence(seed: int = 0, frames: int = 150, size: tuple[int, int] = (320, 240), objects: int = 5,
                    fps: float = 30.0) -> Sequence:
    """Shapes moving, crossing and hiding one another over a textured background; the truth of every frame."""
    rng = np.random.default_rng([44, seed])
    width, height = size
    background = _background(rng, width, height)
    short = min(width, height)
    movers = []
    for object_id in range(1, objects + 1):
        radius = float(rng.uniform(0.08, 0.14) * short)
        speed = float(rng.uniform(0.6, 2.0)) * short / 240  # pixels per frame
        heading = float(rng.uniform(0, 2 * math.pi))
        movers.append(_Mover(object_id, int(rng.integers(1, 5)), radius, float(rng.uniform(0, 2 * math.pi)),
                             _contrasting(rng, background), float(rng.uniform(radius, width - radius)),
                             float(rng.uniform(radius, height - radius)), speed * math.cos(heading),
                             speed * math.sin(heading)))
    sequence = Sequence(f"shapes-{seed}", fps)
    for index in range(frames):
        canvas = Image.fromarray(background)
        owner = np.zeros((height, width), np.int32)  # which object each pixel shows (0: background)
        masks = {}
        for mover in movers:  # in depth order: a later one passes in front
            mask = Image.new("L", (width, height), 0)
            _draw_shape(ImageDraw.Draw(mask), mover, 255)
            _draw_shape(ImageDraw.Draw(canvas), mover, mover.colour)
            masks[mover.object_id] = np.asarray(mask) > 0
            owner[masks[mover.object_id]] = mover.object_id
        noise = np.random.default_rng([44, seed, index]).normal(0, 3, (height, width, 1))
        sequence.frames.append(np.clip(np.asarray(canvas, np.float32) + noise, 0, 255).astype(np.uint8))
        truth = []
        for mover in movers:
            mask = masks[mover.object_id]
            rows, cols = np.nonzero(mask)
            if len(rows) == 0:
                continue
            shown = float((owner == mover.object_id).sum()) / float(len(rows))
            truth.append(Truth(mover.object_id, mover.class_id,
                               (float(cols.min()), float(rows.min()), float(cols.max() + 1), float(rows.max() + 1)),
                               round(shown, 3)))
        sequence.truth.append(truth)
        for mover in movers:
            _step(mover, width, height)
    return sequence


def pan_sequence(photo: Path = ROOT / "samples" / "astronaut.jpg", frames: int = 120,
                 size: tuple[int, int] = (640, 480), fps: float = 30.0,
                 person: tuple[float, float, float, float] = ASTRONAUT_PERSON) -> Sequence:
    """A slow pan (top to bottom, left to right) and zoom (from the photo's width to 80% of it) across `photo`,
    at `size`; the truth is the person's box carried through each frame's crop."""
    image = Image.open(photo).convert("RGB")
    out_w, out_h = size
    aspect = out_w / out_h
    sequence = Sequence(f"pan-{Path(photo).stem}", fps)
    for index in range(frames):
        t = index / max(frames - 1, 1)
        crop_w = image.width * (1.0 - 0.2 * t)
        crop_h = min(crop_w / aspect, image.height)
        left = (image.width - crop_w) * (0.15 + 0.7 * t)
        top = (image.height - crop_h) * t
        box = (left, top, left + crop_w, top + crop_h)
        frame = image.resize(size, Image.BICUBIC, box=box, reducing_gap=None)
        sequence.frames.append(np.asarray(frame, np.uint8))
        sx, sy = out_w / crop_w, out_h / crop_h
        x0, y0 = max(person[0], left), max(person[1], top)
        x1, y1 = min(person[2], left + crop_w), min(person[3], top + crop_h)
        whole = (person[2] - person[0]) * (person[3] - person[1])
        shown = max(0.0, x1 - x0) * max(0.0, y1 - y0) / whole
        sequence.truth.append([Truth(1, 1, ((x0 - left) * sx, (y0 - top) * sy, (x1 - left) * sx, (y1 - top) * sy),
                                     round(shown, 3))])
    return sequence


def write_video(sequence: Sequence, path: Path, codec: str = "libx264", crf: int = 20) -> Path:
    """Encode a sequence as a video file (MP4 with the moov first, WebM or MKV by the suffix)."""
    import av

    container = {".mp4": "mp4", ".mov": "mov", ".webm": "webm", ".mkv": "matroska"}[Path(path).suffix]
    options = {"movflags": "+faststart"} if container in ("mp4", "mov") else {}
    with av.open(str(path), "w", format=container, options=options) as out:
        stream = out.add_stream(codec, rate=Fraction(sequence.fps).limit_denominator(1001))
        stream.width, stream.height = sequence.size
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": str(crf), "preset": "medium"}
        for pixels in sequence.frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return Path(path)


def write_y4m(sequence: Sequence, path: Path) -> Path:
    """Write a sequence as YUV4MPEG2 (4:2:0), the file Chromium's fake camera plays in a loop."""
    import av

    width, height = sequence.size
    with open(path, "wb") as out:
        out.write(f"YUV4MPEG2 W{width} H{height} F{round(sequence.fps)}:1 Ip A1:1 C420jpeg\n".encode())
        for pixels in sequence.frames:
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24").reformat(format="yuv420p")
            out.write(b"FRAME\n")
            for plane, (w, h) in zip(frame.planes, ((width, height), (width // 2, height // 2),
                                                    (width // 2, height // 2))):
                rows = np.frombuffer(plane, np.uint8).reshape(-1, plane.line_size)
                out.write(rows[:h, :w].tobytes())
    return Path(path)


def _background(rng, width: int, height: int) -> np.ndarray:
    """A soft two-colour gradient with a faint texture, as a wall or a table would be."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    a, b = rng.uniform(40, 215, 3), rng.uniform(40, 215, 3)
    mix = ((xs / width) * 0.7 + (ys / height) * 0.3)[..., None]
    texture = 10 * np.sin(xs / 7.0 + ys / 11.0)[..., None]
    return np.clip(a * (1 - mix) + b * mix + texture, 0, 255).astype(np.uint8)


def _contrasting(rng, background: np.ndarray) -> tuple[int, int, int]:
    mean = background.reshape(-1, 3).mean(axis=0)
    for _ in range(50):
        colour = rng.integers(0, 256, 3)
        if np.linalg.norm(colour - mean) >= 120:
            break
    return tuple(int(c) for c in colour)


def _draw_shape(draw: ImageDraw.ImageDraw, mover: _Mover, fill) -> None:
    r, x, y = mover.radius, mover.x, mover.y
    if mover.class_id == 1:
        draw.ellipse([x - r, y - r, x + r, y + r], fill=fill)
        return
    if mover.class_id == 2:
        angles, radii = mover.angle + np.arange(4) * math.pi / 2, np.full(4, r)
    elif mover.class_id == 3:
        angles, radii = mover.angle + np.arange(3) * 2 * math.pi / 3, np.full(3, r)
    else:
        angles = mover.angle + np.arange(10) * math.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, r, 0.45 * r)
    draw.polygon([(float(x + q * math.cos(a)), float(y + q * math.sin(a))) for q, a in zip(radii, angles)], fill=fill)


def _step(mover: _Mover, width: int, height: int) -> None:
    mover.x += mover.vx
    mover.y += mover.vy
    if not mover.radius <= mover.x <= width - mover.radius:
        mover.vx = -mover.vx
        mover.x = min(max(mover.x, mover.radius), width - mover.radius)
    if not mover.radius <= mover.y <= height - mover.radius:
        mover.vy = -mover.vy
        mover.y = min(max(mover.y, mover.radius), height - mover.radius)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.sequences", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", action="store_true",
                        help="write the committed samples: samples/shapes.mp4 and samples/pan.mp4")
    parser.add_argument("--y4m", type=Path, default=None, help="write the shapes sequence as a .y4m here")
    args = parser.parse_args(argv)
    if args.samples:
        print(write_video(shapes_sequence(seed=0, frames=150), ROOT / "samples" / "shapes.mp4"))
        print(write_video(pan_sequence(), ROOT / "samples" / "pan.mp4"))
    if args.y4m:
        print(write_y4m(shapes_sequence(seed=0, frames=150), args.y4m))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
