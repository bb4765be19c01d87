"""The test images: deterministic JPEG scenes, shapes on a textured gradient, at any size."""

from __future__ import annotations

import io
from pathlib import Path

IMAGE_SIZE = (640, 480)


def make_images(folder: Path, count: int = 16, seed: int = 0, size: tuple[int, int] = IMAGE_SIZE) -> Path:
    """Write `count` deterministic JPEG scenes (shapes on a textured gradient) of `size` to `folder`.

    Shapes are scaled with the image, the grain is not: a 4032x3024 scene is about 1.5 MB, as a phone's
    JPEG of a 12 MP photo is.
    """
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    folder.mkdir(parents=True, exist_ok=True)
    width, height = size
    scale = min(width / IMAGE_SIZE[0], height / IMAGE_SIZE[1])
    for i in range(count):
        path = folder / f"scene-{i:02d}.jpg"
        if path.exists():
            continue
        rng = np.random.default_rng([seed, i])
        ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
        a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        mix = (xs / width * rng.uniform(0.3, 1) + ys / height * rng.uniform(0.3, 1))[..., None] / 2
        base = a * (1 - mix) + b * mix + rng.normal(0, 12, (height, width, 3))
        canvas = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(1))
        draw = ImageDraw.Draw(canvas)
        for _ in range(int(rng.integers(3, 9))):
            cx, cy = rng.uniform(0, width), rng.uniform(0, height)
            r = rng.uniform(20, 120) * scale
            colour = tuple(int(c) for c in rng.integers(0, 256, 3))
            kind = int(rng.integers(0, 4))
            if kind == 0:
                draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
            elif kind == 1:
                draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour)
            else:
                points = 3 if kind == 2 else 10
                angles = rng.uniform(0, 2 * np.pi) + np.arange(points) * 2 * np.pi / points
                radii = np.full(points, r) if kind == 2 else np.where(np.arange(points) % 2, r * 0.45, r)
                draw.polygon([(cx + q * np.cos(t), cy + q * np.sin(t)) for q, t in zip(radii, angles)], fill=colour)
        buffer = io.BytesIO()
        canvas.save(buffer, format="JPEG", quality=90)
        path.write_bytes(buffer.getvalue())
    return folder
