"""Decode uploaded bytes into RGB arrays with Pillow, safely.

Only the allowlisted decoders run (EPS never reaches Ghostscript); the pixel limit is checked from
the header before any pixel is decoded; EXIF orientation is applied so boxes are in the image as
the user sees it; every mode is converted to 8-bit RGB (alpha dropped, as TensorFlow's decoders do).
Called in WSGI request threads; thread-safe. The process calls `app.process.configure_pillow` first.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image

from ..errors import ImageTooLarge, InvalidImage, UnsupportedImageFormat

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")

# Magic numbers of formats Pillow knows but we refuse, so the answer is 415, not 400.
_REFUSED_MAGIC = {
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
    b"%!PS": "EPS",
    b"\xc5\xd0\xd3\xc6": "EPS",
    b"%PDF": "PDF",
    b"\x00\x00\x01\x00": "ICO",
    b"8BPS": "PSD",
    b"\x00\x00\x00\x0cjP": "JPEG 2000",
    b"\xff\x4f\xff\x51": "JPEG 2000",
    b"qoif": "QOI",
    b"DDS ": "DDS",
}


@dataclass(frozen=True)
class DecodedImage:
    """An RGB uint8 array [height, width, 3] and the format it came in."""

    pixels: np.ndarray
    format: str

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])


def decode_image(data: bytes, max_pixels: int) -> DecodedImage:
    """Decode one image; raise InvalidImage, UnsupportedImageFormat or ImageTooLarge."""
    if not data:
        raise InvalidImage("the image is empty")
    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.UnidentifiedImageError:
        refused = _refused_format(data)
        if refused:
            raise UnsupportedImageFormat(
                f"{refused} images are not accepted; send JPEG, PNG, WebP, BMP or GIF"
            ) from None
        raise InvalidImage("the bytes are not a JPEG, PNG, WebP, BMP or GIF image") from None
    except Exception as exc:  # Pillow raises many types for malformed headers
        raise InvalidImage(f"the image header cannot be read: {exc}") from None
    with image:
        width, height = image.size
        if width <= 0 or height <= 0:
            raise InvalidImage(f"the image is {width}x{height}: it has no pixels")
        if width * height > max_pixels:
            raise ImageTooLarge(
                f"the image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}"
            )
        fmt = image.format or "unknown"
        try:
            image.seek(0)  # GIF and animated WebP: the first frame only
            image.load()
            rgb = _to_rgb(_upright(image))
        except (ImageTooLarge, InvalidImage):
            raise
        except Exception as exc:  # truncated or corrupt data surfaces here, as OSError, ValueError, ...
            raise InvalidImage(f"the {fmt} image is corrupt or truncated: {exc}") from None
    return DecodedImage(pixels=rgb, format=fmt)


def _refused_format(data: bytes) -> str | None:
    for magic, name in _REFUSED_MAGIC.items():
        if data.startswith(magic):
            return name
    return None


_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _upright(image: Image.Image) -> Image.Image:
    """Apply EXIF orientation; malformed EXIF or an orientation outside 1-8 leaves the image as stored.

    ImageOps.exif_transpose would do the same but copy every image that needs no turn and rewrite the EXIF
    of every one that does; only the pixels matter here.
    """
    try:
        orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
    except Exception:  # malformed EXIF must not fail the request
        return image
    method = _TRANSPOSE.get(orientation) if type(orientation) is int else None
    return image if method is None else image.transpose(method)


def _to_rgb(image: Image.Image) -> np.ndarray:
    mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N"):
        wide = np.asarray(image, dtype=np.uint16)
        grey = (wide >> 8).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    if mode == "I":
        grey = np.clip(np.asarray(image, dtype=np.int64) >> 8, 0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    if mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    elif mode == "PA":
        image = image.convert("RGBA")
    if image.mode != "RGB":
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.uint8)
