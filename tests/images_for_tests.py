"""Encode test images in the forms clients send: formats, modes, EXIF orientations."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

# What a viewer does to the stored pixels for each EXIF orientation, written with numpy alone.
ORIENT = {
    1: lambda a: a,
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, k=-1),
    7: lambda a: np.rot90(a, k=-1)[::-1],
    8: lambda a: np.rot90(a, k=1),
}


def encode(pixels: np.ndarray, fmt: str = "PNG", orientation: int | None = None, **save) -> bytes:
    """Encode an RGB array; with `orientation`, store it in EXIF (the pixels are stored as given)."""
    image = Image.fromarray(pixels)
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        save["exif"] = exif.tobytes()
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def encode_image(image: Image.Image, fmt: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()
