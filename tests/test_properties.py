"""Properties of decoding and parameter parsing, checked by hypothesis over inputs no one would write by hand.

Decoding: any bytes end in a DecodedImage or one of the project's three image errors; any image Pillow can
write as PNG comes back as exactly the RGB the mode means; EXIF orientation turns the image as a viewer would.
Parsing: parse_threshold and parse_max_detections accept exactly their valid sets; images_from_json raises
nothing but InvalidBody. Example counts are kept small so the module runs in seconds.
"""

from __future__ import annotations

import io
import json
import math
import string

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from PIL import Image

from app.http.detect_request import MAX_DETECTIONS_LIMIT, images_from_json, parse_max_detections, parse_threshold
from app.errors import ImageTooLarge, InvalidBody, InvalidImage, InvalidParameter, UnsupportedImageFormat
from app.inference.images import DecodedImage, decode_image

from images_for_tests import ORIENT, encode_image

FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_PIXELS = 1_000_000
IMAGE_ERRORS = (InvalidImage, UnsupportedImageFormat, ImageTooLarge)


# ---------------------------------------------------------------------------------------------------------------
# Decoding


def _seed_images() -> list[bytes]:
    """Small valid images of each allowed format, for the mutation strategy to damage."""
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (9, 7, 3), dtype=np.uint8))
    return [
        encode_image(image, "PNG"),
        encode_image(image, "JPEG", quality=80),
        encode_image(image, "JPEG", quality=80, progressive=True, exif=_exif(6)),
        encode_image(image.convert("P"), "GIF"),
        encode_image(image, "BMP"),
        encode_image(image, "WEBP", lossless=True),
        encode_image(image.convert("RGBA"), "WEBP", quality=50),
    ]


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


SEEDS = _seed_images()
MAGIC = [b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"GIF87a", b"BM", b"RIFF\x00\x00\x00\x00WEBPVP8 ",
         b"II*\x00", b"%!PS", b"%PDF", b"\xc5\xd0\xd3\xc6"]


@st.composite
def damaged_images(draw) -> bytes:
    """A valid small image with some bytes overwritten, some cut, or some inserted."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        where = draw(st.integers(0, len(data) - 1))
        action = draw(st.sampled_from(["set", "cut", "insert"]))
        if action == "set":
            data[where] = draw(st.integers(0, 255))
        elif action == "cut":
            del data[where:where + draw(st.integers(1, 64))]
        else:
            data[where:where] = draw(st.binary(min_size=1, max_size=8))
        if not data:
            break
    return bytes(data)


ANY_BYTES = st.one_of(
    st.binary(max_size=2048),
    st.builds(lambda magic, tail: magic + tail, st.sampled_from(MAGIC), st.binary(max_size=512)),
    damaged_images(),
)


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow's "corrupt EXIF" and such: in the server, log lines
@FEW
@given(ANY_BYTES)
@example(b"")
@example(b"\x89PNG\r\n\x1a\n")
def test_any_bytes_decode_or_raise_one_of_the_three_image_errors(data):
    try:
        decoded = decode_image(data, MAX_PIXELS)
    except IMAGE_ERRORS:
        return
    assert isinstance(decoded, DecodedImage)
    assert decoded.pixels.dtype == np.uint8 and decoded.pixels.ndim == 3 and decoded.pixels.shape[2] == 3
    assert 0 < decoded.width * decoded.height <= MAX_PIXELS


def _expected_rgb(image: Image.Image) -> np.ndarray:
    """What each mode means in 8-bit RGB, worked out with numpy alone: alpha dropped, 16 bits to their high byte."""
    mode, raw = image.mode, np.asarray(image)
    if mode == "RGB":
        return raw
    if mode == "RGBA":
        return raw[..., :3]
    if mode == "L":
        return np.repeat(raw[..., None], 3, axis=2)
    if mode == "LA":
        return np.repeat(raw[..., :1], 3, axis=2)
    if mode == "1":
        return np.repeat(np.where(raw, 255, 0).astype(np.uint8)[..., None], 3, axis=2)
    if mode == "I;16":
        return np.repeat((raw >> 8).astype(np.uint8)[..., None], 3, axis=2)
    if mode == "P":
        palette = np.array(image.getpalette("RGB"), np.uint8).reshape(-1, 3)
        return palette[raw]
    raise AssertionError(mode)


@st.composite
def pillow_images(draw) -> Image.Image:
    width, height = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    mode = draw(st.sampled_from(["RGB", "RGBA", "L", "LA", "1", "I;16", "P"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 2**16, (height, width), dtype=np.uint16))
    if mode == "1":
        return Image.fromarray(rng.integers(0, 2, (height, width), dtype=np.uint8) * 255).convert("1")
    if mode == "P":
        colours = draw(st.integers(1, 256))
        image = Image.fromarray(rng.integers(0, colours, (height, width), dtype=np.uint8), "P")
        image.putpalette(rng.integers(0, 256, colours * 3, dtype=np.uint8).tobytes())
        if draw(st.booleans()):
            image.info["transparency"] = draw(st.integers(0, colours - 1))
        return image
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


@FEW
@given(pillow_images())
def test_any_image_round_trips_through_png_as_exactly_the_rgb_its_mode_means(image):
    data = io.BytesIO()
    image.save(data, format="PNG", **({"transparency": image.info["transparency"]}
                                      if "transparency" in image.info else {}))
    reread = Image.open(io.BytesIO(data.getvalue()))  # what PNG kept: Pillow may store a narrower palette
    decoded = decode_image(data.getvalue(), MAX_PIXELS)
    assert decoded.format == "PNG"
    np.testing.assert_array_equal(decoded.pixels, _expected_rgb(reread))


@FEW
@given(st.integers(1, 20), st.integers(1, 20), st.integers(0, 2**16 - 1), st.integers(0, 2**32 - 1))
@example(5, 3, 6, 0)
@example(5, 3, 0, 0)
@example(5, 3, 9, 0)
def test_an_exif_orientation_turns_the_image_as_a_viewer_would(width, height, orientation, seed):
    """1-8 turn as the EXIF standard says (ORIENT), pixel for pixel in PNG; anything else leaves it as stored."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    data = encode_image(Image.fromarray(pixels), "PNG", exif=_exif(orientation))
    expected = ORIENT.get(orientation, ORIENT[1])(pixels)
    decoded = decode_image(data, MAX_PIXELS)
    assert decoded.pixels.shape == expected.shape
    np.testing.assert_array_equal(decoded.pixels, expected)


# ---------------------------------------------------------------------------------------------------------------
# Parameters


NUMBER_TEXT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.decimals(allow_nan=True, allow_infinity=True).map(str),
    st.integers(-10**400, 10**400).map(str),
    st.text(alphabet=string.digits + ".-+eE_ infna", max_size=12),
    st.text(max_size=20),
)


@FEW
@given(NUMBER_TEXT)
@example("1e309")
@example("NaN")
@example("-0")
@example("1.0000000000000000001")
def test_parse_threshold_accepts_exactly_the_numbers_from_0_to_1(raw):
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    valid = math.isfinite(value) and 0.0 <= value <= 1.0
    try:
        parsed = parse_threshold(raw, 0.5)
    except InvalidParameter:
        assert not valid, raw
    else:
        assert valid and parsed == value, raw


def _is_valid_max_detections(raw: str) -> bool:
    text = raw.strip()
    digits = text.lstrip("0")
    return (text != "" and all(c in string.digits for c in text) and len(digits) <= 4
            and 1 <= int(digits or "0") <= MAX_DETECTIONS_LIMIT)


@FEW
@given(st.one_of(
    st.integers(-5, 2 * MAX_DETECTIONS_LIMIT).map(str),
    st.builds(lambda zeros, n: "0" * zeros + str(n), st.integers(0, 8), st.integers(0, 1200)),
    st.builds(lambda pad, n: pad + str(n) + pad, st.sampled_from([" ", "\t", "\n", "\u2003"]), st.integers(1, 1000)),
    st.text(alphabet=string.digits + " +-.e_\u0663", max_size=8),
    st.text(max_size=12),
))
@example("00001")
@example("0" * 5000 + "7")  # int() of the whole text would raise ValueError past 4300 digits
@example("1000000000")
@example("10^9")
@example("\u0663")  # ARABIC-INDIC DIGIT THREE: a digit, but not ASCII
def test_parse_max_detections_accepts_exactly_the_integers_from_1_to_1000(raw):
    try:
        parsed = parse_max_detections(raw)
    except InvalidParameter:
        assert not _is_valid_max_detections(raw), raw
    else:
        assert _is_valid_max_detections(raw) and parsed == int(raw.strip().lstrip("0")), raw


def test_absent_parameters_take_their_defaults():
    assert parse_threshold(None, 0.25) == 0.25
    assert parse_max_detections(None) == 100


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
    | st.sampled_from(["AAAA", "iVBORw0KGgo=", "data:image/png;base64,AAAA", "A-_B", "====", "AAA"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["image", "images", "x"]) | st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)
JSON_BODIES = st.one_of(
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["image", "images"]), JSON_VALUES, max_size=2).map(
        lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.builds(lambda depth: b"[" * depth + b"]" * depth, st.integers(0, 200000)),
)


@FEW
@given(JSON_BODIES)
@example(b'{"image": "\xff"}')
@example(b'{"images": [' + b'"AAAA",' * 3 + b'12]}')
@example(b'{"image": ' + b"9" * 5000 + b"}")
def test_images_from_json_returns_bytes_or_raises_invalid_body(body):
    try:
        blobs, plural = images_from_json(body)
    except InvalidBody:
        return
    assert isinstance(plural, bool) and blobs
    assert all(isinstance(blob, bytes) for blob in blobs)
