"""Decode uploaded bytes into RGB arrays with Pillow, safely.

Only the allowlisted decoders run (EPS never reaches Ghostscript); the pixel limit is checked from
the header before any pixel is decoded; EXIF orientation is applied so boxes are in the image as
the user sees it; every mode is converted to 8-bit RGB (alpha dropped, as TensorFlow's decoders do).

Given a model's working size (app/inference/working_size.py), an image is decoded no larger than the
model needs: a JPEG by its decoder's own scaling (1/2, 1/4 or 1/8, in the DCT domain, so the skipped
pixels are never made), then any image reduced the rest of the way. The DecodedImage keeps the
original's displayed width and height, for the answer and its boxes. Asked for the picture as well
(`picture_side`, for an answer drawn on the image: app/vision/annotate.py), it is decoded once, at the
larger of the two sizes, and kept upright beside the model's pixels.
Called in WSGI request threads; thread-safe. The process calls `app.process.configure_pillow` first.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Optional

import numpy as np
from PIL import ExifTags, Image, JpegImagePlugin

from ..errors import ImageTooLarge, InvalidImage, UnsupportedImageFormat
from .working_size import WorkingSize

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
    """What the model sees, and the size of the image the user sees.

    `pixels` is RGB uint8 [rows, columns, 3], upright, possibly reduced; `width` and `height` are
    the original's, after EXIF orientation: answers and boxes are given in them.
    """

    pixels: np.ndarray
    format: str
    width: int
    height: int
    picture: Optional[Image.Image] = None  # upright RGB, longest side at most picture_side; only when asked


def decode_image(data: bytes, max_pixels: int, working_size: Optional[WorkingSize] = None,
                 picture_side: Optional[int] = None) -> DecodedImage:
    """Decode one image, no larger than `working_size` needs (None: full size).

    With `picture_side`, also keep the upright picture, its longest side at most that (0: full size).
    Raise InvalidImage, UnsupportedImageFormat or ImageTooLarge.
    """
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
    picture = None
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
            _draft(image, working_size, _picture_scale(picture_side, width, height))
            image.load()
            orientation = _orientation(image)
            if orientation in _SWAPS_SIDES:
                width, height = height, width
            upright = _to_rgb(_turn(image, orientation))
            rgb = _reduce(upright, working_size, (width, height))
            if picture_side is not None:
                picture = _fit(upright, picture_side)
        except (ImageTooLarge, InvalidImage):
            raise
        except Exception as exc:  # truncated or corrupt data surfaces here, as OSError, ValueError, ...
            raise InvalidImage(f"the {fmt} image is corrupt or truncated: {exc}") from None
    return DecodedImage(pixels=np.asarray(rgb, dtype=np.uint8), format=fmt, width=width, height=height,
                        picture=picture)


def _picture_scale(picture_side: Optional[int], width: int, height: int) -> float:
    """The least scale the picture may be decoded at: 0 when none is asked for, 1 for full size."""
    if picture_side is None:
        return 0.0
    if picture_side == 0:
        return 1.0
    return min(1.0, picture_side / max(width, height))


def _fit(image: Image.Image, side: int) -> Image.Image:
    """The upright picture with its longest side at most `side` (0: as it is). It may be the image the model's
    pixels were copied from (np.asarray copies), so drawing on it later changes nothing the model sees."""
    longest = max(image.size)
    if side and longest > side:
        scale = side / longest
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        return image.resize(size, Image.BILINEAR, reducing_gap=2.0)
    return image


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
_SWAPS_SIDES = (5, 6, 7, 8)  # orientations whose turn swaps width and height


def _orientation(image: Image.Image) -> int:
    """Return the EXIF orientation; 1 (as stored) where it is missing, malformed or outside 1-8.

    A JPEG's EXIF is read at open, so this may run before load(); other formats may load to find it.
    """
    try:
        orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
    except Exception:  # malformed EXIF must not fail the request
        return 1
    return orientation if type(orientation) is int and orientation in _TRANSPOSE else 1


def _turn(image: Image.Image, orientation: int) -> Image.Image:
    """Apply an EXIF orientation, so the pixels are as the user sees them.

    ImageOps.exif_transpose would do the same but copy every image that needs no turn and rewrite the EXIF
    of every one that does; only the pixels matter here.
    """
    method = _TRANSPOSE.get(orientation)
    return image if method is None else image.transpose(method)


# A JPEG decoder's scale may fall this far short of a cascade's scale (MTCNN's 0.709 squared is 0.5027,
# a 1/2 decode gives 0.5): the decoded image is then enlarged by under 2% to the exact scale, at a
# fraction of the cost of decoding at full size.
DRAFT_SLACK = 0.02


def _draft(image: Image.Image, working_size: Optional[WorkingSize], picture_scale: float = 0.0) -> None:
    """Have the JPEG decoder scale by 1/2, 1/4 or 1/8 where the working size (and the picture asked for, at
    `picture_scale` of the image at least) allow; before load().

    The scale is worked out on the size as displayed: a turn by EXIF swaps width and height, and the
    working size is the model's, upright. The scale itself is the same along both sides.
    """
    if not isinstance(image, JpegImagePlugin.JpegImageFile) or (working_size is None and picture_scale >= 1.0):
        return
    width, height = image.size
    turned = _orientation(image) in _SWAPS_SIDES
    least = 1.0 if working_size is None else (
        working_size.scale(*((height, width) if turned else (width, height))) * (1 - DRAFT_SLACK))
    least = max(least, picture_scale)
    scale = next(s for s in (8, 4, 2, 1) if 1 / s >= least)
    if scale > 1:
        # Pillow picks the largest scale whose result is at least the size asked for: ask for exactly 1/scale.
        image.draft(None, (max(1, width // scale), max(1, height // scale)))


def _reduce(image: Image.Image, working_size: Optional[WorkingSize], original: tuple[int, int]) -> Image.Image:
    """Bring an upright RGB image, possibly drafted, down to the working size; `original` is its full size.

    By whole factors, a box average (Image.reduce): every source pixel counts once, as in the JPEG
    decoder's own scaling. By a scale step, a bicubic resize to the exact size of that scale. Done after
    the conversion to RGB, so palette images average colours, not palette indices.
    """
    if working_size is None:
        return image
    if working_size.scale_step:
        target = working_size.target_size(*original)
        return image if image.size == target else image.resize(target, Image.BICUBIC, reducing_gap=2.0)
    factor = working_size.reduction(*image.size)
    return image.reduce(factor) if factor > 1 else image


def _to_rgb(image: Image.Image) -> Image.Image:
    mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N"):
        wide = np.asarray(image, dtype=np.uint16)
        grey = (wide >> 8).astype(np.uint8)
        return Image.fromarray(np.repeat(grey[..., None], 3, axis=2))
    if mode == "I":
        grey = np.clip(np.asarray(image, dtype=np.int64) >> 8, 0, 255).astype(np.uint8)
        return Image.fromarray(np.repeat(grey[..., None], 3, axis=2))
    if mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    elif mode == "PA":
        image = image.convert("RGBA")
    if image.mode != "RGB":
        image = image.convert("RGB")
    return image
