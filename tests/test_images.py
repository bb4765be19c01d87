"""Decoding: allowlisted formats, limits from the header, EXIF orientation, every mode to RGB."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from app.errors import ImageTooLarge, InvalidImage, UnsupportedImageFormat
from app.inference.images import decode_image

from images_for_tests import ORIENT, encode, encode_image

LIMIT = 40_000_000


def _rgb(width=8, height=6):
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "WEBP"])
def test_lossless_formats_decode_exactly(fmt):
    pixels = _rgb()
    save = {"lossless": True} if fmt == "WEBP" else {}
    decoded = decode_image(encode(pixels, fmt, **save), LIMIT)
    assert decoded.format == fmt
    assert np.array_equal(decoded.pixels, pixels)


def test_jpeg_decodes_close_to_the_original():
    pixels = np.full((16, 16, 3), (200, 40, 90), np.uint8)
    decoded = decode_image(encode(pixels, "JPEG", quality=95), LIMIT)
    assert decoded.pixels.shape == (16, 16, 3)
    assert np.abs(decoded.pixels.astype(int) - pixels).max() <= 4


def test_only_the_first_gif_frame_is_decoded():
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    data = encode_image(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert tuple(decode_image(data, LIMIT).pixels[0, 0]) == (255, 0, 0)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(orientation):
    pixels = _rgb(6, 4)
    decoded = decode_image(encode(pixels, "JPEG", orientation=orientation, quality=100, subsampling=0), LIMIT)
    expected = ORIENT[orientation](pixels)
    assert decoded.pixels.shape == expected.shape
    assert np.abs(decoded.pixels.astype(int) - expected).mean() < 12


@pytest.mark.parametrize(
    "mode, fill, expected",
    [
        ("L", 77, (77, 77, 77)),
        ("LA", (77, 10), (77, 77, 77)),
        ("RGBA", (10, 20, 30, 0), (10, 20, 30)),
        ("CMYK", (0, 255, 255, 0), (255, 0, 0)),
    ],
)
def test_modes_convert_to_rgb(mode, fill, expected):
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    data = encode_image(Image.new(mode, (4, 4), fill), fmt, **({"quality": 100} if fmt == "JPEG" else {}))
    pixel = decode_image(data, LIMIT).pixels[0, 0]
    assert np.abs(pixel.astype(int) - expected).max() <= 3


def test_palette_with_transparency_converts_to_rgb():
    image = Image.new("P", (4, 4), 1)
    image.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    data = encode_image(image, "PNG", transparency=0)
    assert tuple(decode_image(data, LIMIT).pixels[0, 0]) == (200, 100, 50)


def test_sixteen_bit_grey_keeps_its_high_byte():
    image = Image.fromarray(np.full((4, 4), 0xAB12, np.uint16))
    pixel = decode_image(encode_image(image, "PNG"), LIMIT).pixels[0, 0]
    assert tuple(pixel) == (0xAB, 0xAB, 0xAB)


def _png_header_only(width, height):
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 10))


def test_the_pixel_limit_is_checked_from_the_header_before_decoding():
    with pytest.raises(ImageTooLarge, match="30000x30000 = 900000000 pixels, over the limit of 40000000"):
        decode_image(_png_header_only(30000, 30000), LIMIT)


@pytest.mark.parametrize(
    "data, error, fragment",
    [
        (b"", InvalidImage, "empty"),
        (b"\xff\xd8\xff" + bytes(range(256)) * 4, InvalidImage, "not a JPEG"),
        (b"hello world, not an image", InvalidImage, "not a JPEG, PNG, WebP, BMP or GIF"),
        (b"II*\x00" + b"\x00" * 100, UnsupportedImageFormat, "TIFF images are not accepted"),
        (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", UnsupportedImageFormat, "EPS"),
        (b"%PDF-1.4\n", UnsupportedImageFormat, "PDF"),
    ],
)
def test_bad_bytes_are_refused_with_the_right_error(data, error, fragment):
    with pytest.raises(error, match=fragment):
        decode_image(data, LIMIT)


def test_a_truncated_jpeg_is_refused():
    data = encode(_rgb(64, 64), "JPEG")
    with pytest.raises(InvalidImage, match="corrupt or truncated"):
        decode_image(data[: len(data) // 2], LIMIT)
