"""Decoding at a model's working size: the size read from the model folder, the reduced pixels, the original's size.

No TensorFlow here: the working size and the decoding are plain Python, as the HTTP process needs them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from PIL import Image, JpegImagePlugin

from app.errors import ImageTooLarge, ModelError
from app.inference.images import decode_image
from app.inference.working_size import WorkingSize, read_working_size

from conftest import ROOT
from images_for_tests import ORIENT, encode, encode_image

LIMIT = 40_000_000
SHAPES = WorkingSize(width=256, height=256)  # models/shapes/1: its input size
FACES = WorkingSize(longest_side=1920, scale_step=0.709)  # models/faces/1: MTCNN's pyramid step


def gradient(width: int, height: int) -> np.ndarray:
    """A smooth RGB image: JPEG keeps it well, so decodings at different scales can be compared."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    return np.stack([xs / width * 255, ys / height * 255, (xs + ys) / (width + height) * 255], -1).astype(np.uint8)


# -- the working size of a model ------------------------------------------------------------------


def test_the_committed_models_declare_their_working_sizes():
    assert read_working_size(ROOT / "models" / "shapes" / "1") == SHAPES
    assert read_working_size(ROOT / "models" / "faces" / "1") == FACES


@pytest.mark.parametrize("info, expected", [
    (None, None),  # no model_info.json: full size, as before
    ({"classes": ["a"]}, None),  # neither working_size nor input_size
    ({"input_size": {"height": 300, "width": 400}}, WorkingSize(width=400, height=300)),
    ({"working_size": {"longest_side": 1000}, "input_size": {"height": 8, "width": 8}},
     WorkingSize(longest_side=1000)),  # the explicit one wins
    ({"working_size": {"height": 50, "scale_step": 0.5}}, WorkingSize(height=50, scale_step=0.5)),
])
def test_the_working_size_comes_from_model_info(tmp_path, info, expected):
    if info is not None:
        (tmp_path / "model_info.json").write_text(json.dumps(info))
    assert read_working_size(tmp_path) == expected


@pytest.mark.parametrize("text, fragment", [
    ("{not json", "cannot be read as JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"working_size": 256}', "working_size must be an object"),
    ('{"working_size": {}}', "working_size must be an object"),
    ('{"working_size": {"scale_step": 0.7}}', "working_size must be an object"),
    ('{"working_size": {"short_side": 5}}', "working_size must be an object"),
    ('{"input_size": {"longest_side": 5}}', "input_size must be an object with some of width, height"),
    ('{"input_size": {"width": 0}}', "input_size.width must be a whole number of pixels, 1 or more"),
    ('{"working_size": {"width": 25.5}}', "working_size.width must be a whole number"),
    ('{"working_size": {"width": true}}', "working_size.width must be a whole number"),
    ('{"working_size": {"width": 5, "scale_step": 1}}', "scale_step must be a number between 0 and 1"),
    ('{"working_size": {"width": 5, "scale_step": "0.7"}}', "scale_step must be a number between 0 and 1"),
])
def test_a_bad_model_info_is_a_model_error_naming_the_file(tmp_path, text, fragment):
    (tmp_path / "model_info.json").write_text(text)
    with pytest.raises(ModelError, match=fragment) as caught:
        read_working_size(tmp_path)
    assert str(tmp_path / "model_info.json") in caught.value.message


@pytest.mark.parametrize("size, width, height, factor", [
    (SHAPES, 4032, 3024, 11),  # 3024 // 256
    (SHAPES, 640, 480, 1),  # 480 px high cannot be halved and still cover 256
    (SHAPES, 255, 1000, 1),  # under the working size: never enlarged, never reduced
    (WorkingSize(width=500, height=100), 2000, 1000, 4),
    (WorkingSize(width=500, height=100), 1000, 2000, 2),  # the same photo turned: width is what binds
    (WorkingSize(longest_side=1920), 4032, 3024, 2),
    (WorkingSize(longest_side=1920), 3024, 4032, 2),
    (WorkingSize(), 4032, 3024, 1),  # no bound, no reduction
])
def test_the_reduction_is_the_largest_whole_factor_that_still_covers(size, width, height, factor):
    assert size.reduction(width, height) == factor


@pytest.mark.parametrize("width, height, target", [
    (4032, 3024, (2027, 1520)),  # 0.709 ** 2
    (3024, 4032, (1520, 2027)),
    (3024, 3024, (2144, 2144)),  # 0.709
    (6000, 4000, (2138, 1426)),  # 0.709 ** 3
    (1920, 1080, (1920, 1080)),
    (640, 480, (640, 480)),
])
def test_a_scale_step_scales_by_its_whole_powers_only(width, height, target):
    assert FACES.target_size(width, height) == target


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20000), st.integers(1, 20000), st.integers(0, 3000), st.integers(0, 3000),
       st.integers(0, 3000), st.sampled_from([0.0, 0.5, 0.709, 0.9]))
@example(4032, 3024, 256, 256, 0, 0.0)
def test_the_scale_is_the_smallest_that_covers_the_working_size_or_none(width, height, need_w, need_h, longest, step):
    size = WorkingSize(width=need_w, height=need_h, longest_side=longest, scale_step=step)
    scale = size.scale(width, height)
    assert 0 < scale <= 1
    if scale < 1:  # reduced: what is left still covers the working size
        assert size.covers(width * scale, height * scale)
    if step:  # a whole power of the step, and one more step would not cover
        power = round(np.log(scale) / np.log(step))
        assert scale == pytest.approx(step ** power)
        if need_w or need_h or longest:
            assert not size.covers(width * scale * step, height * scale * step)
    else:  # 1/k for a whole k, and k + 1 would not keep whole blocks covering it
        k = round(1 / scale)
        assert scale == pytest.approx(1 / k)
        bounds = [side // need for side, need in ((width, need_w), (height, need_h),
                                                  (max(width, height), longest)) if need]
        assert k == max(1, min(bounds)) if bounds else k == 1


# -- decoding at the working size -----------------------------------------------------------------


@pytest.mark.parametrize("size, expected", [
    ((4032, 3024), (504, 378)),  # 1/8 by the JPEG decoder
    ((2048, 1536), (512, 384)),  # 1/4: 1/8 would leave 192 rows
    ((640, 480), (640, 480)),  # nothing to gain: decoded as it is
])
def test_a_jpeg_is_decoded_at_the_smallest_decoder_scale_that_covers_the_model(size, expected):
    data = encode(gradient(*size), "JPEG", quality=90)
    decoded = decode_image(data, LIMIT, SHAPES)
    assert decoded.pixels.shape == (expected[1], expected[0], 3)
    assert (decoded.width, decoded.height) == size  # the answer's width and height are the original's


def test_the_jpeg_decoder_does_the_scaling_itself(monkeypatch):
    """Image.draft is asked for 1/8 before any pixel is decoded, so the full-size pixels are never made."""
    asked = []
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        asked.append((self.size, size))
        return original(self, mode, size)

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    decode_image(encode(gradient(4032, 3024), "JPEG"), LIMIT, SHAPES)
    assert asked == [((4032, 3024), (504, 378))]
    asked.clear()
    decode_image(encode(gradient(4032, 3024), "JPEG"), LIMIT)
    assert asked == []  # no working size: full size, as before


def test_the_reduced_pixels_are_those_of_the_full_decoding_averaged():
    data = encode(gradient(4032, 3024), "JPEG", quality=95)
    full = decode_image(data, LIMIT).pixels.astype(np.float32)
    reduced = decode_image(data, LIMIT, SHAPES).pixels.astype(np.float32)
    blocks = full.reshape(378, 8, 504, 8, 3).mean(axis=(1, 3))
    assert np.abs(reduced - blocks).mean() < 1.5


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_turns_are_applied_and_the_turned_image_still_covers_the_working_size(orientation):
    """Stored 2000x1000; the working size is 500 wide and 100 high, upright, so a turn changes the factor."""
    size = WorkingSize(width=500, height=100)
    pixels = gradient(2000, 1000)
    data = encode(pixels, "JPEG", orientation=orientation, quality=95)
    decoded = decode_image(data, LIMIT, size)
    shown = ORIENT[orientation](pixels)
    assert (decoded.width, decoded.height) == (shown.shape[1], shown.shape[0])
    factor = size.reduction(decoded.width, decoded.height)  # 4 upright, 2 turned
    assert factor == (2 if orientation >= 5 else 4)
    assert decoded.pixels.shape == (shown.shape[0] // factor, shown.shape[1] // factor, 3)
    expected = shown.reshape(shown.shape[0] // factor, factor, shown.shape[1] // factor, factor, 3).mean(axis=(1, 3))
    assert np.abs(decoded.pixels.astype(np.float32) - expected).mean() < 2.0


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "WEBP", "GIF"])
def test_other_formats_are_decoded_then_reduced_by_a_box_average(fmt):
    pixels = gradient(1000, 600)
    save = {"lossless": True} if fmt == "WEBP" else {}
    decoded = decode_image(encode(pixels, fmt, **save), LIMIT, SHAPES)
    assert decoded.pixels.shape == (300, 500, 3)  # 600 // 256 = 2
    assert (decoded.width, decoded.height) == (1000, 600)
    if fmt != "GIF":  # GIF's palette is not the gradient's colours; its shape is what counts here
        blocks = pixels.reshape(300, 2, 500, 2, 3).mean(axis=(1, 3))
        assert np.abs(decoded.pixels.astype(np.float32) - blocks).max() <= 1.0


def test_a_palette_image_averages_colours_not_palette_indices():
    image = Image.new("P", (512, 512))
    image.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    image.putdata([(x + y) % 2 for y in range(512) for x in range(512)])  # red and blue, a checkerboard
    decoded = decode_image(encode_image(image, "PNG"), LIMIT, WorkingSize(width=256, height=256))
    assert decoded.pixels.shape == (256, 256, 3)
    assert np.abs(decoded.pixels.astype(int) - (128, 0, 128)).max() <= 1


def test_a_cascade_photo_is_scaled_to_an_exact_power_of_its_step():
    """4032x3024 at 0.709 ** 2: the JPEG decoder's 1/2 (2016x1512), then enlarged by 0.5% to 2027x1520."""
    for fmt in ("JPEG", "PNG"):
        decoded = decode_image(encode(gradient(4032, 3024), fmt), LIMIT, FACES)
        assert decoded.pixels.shape == (1520, 2027, 3)
        assert (decoded.width, decoded.height) == (4032, 3024)


@pytest.mark.parametrize("fmt, mode, save", [
    ("JPEG", "L", {}),
    ("JPEG", "CMYK", {}),
    ("JPEG", "RGB", {"progressive": True}),
    ("PNG", "I;16", {}),
    ("PNG", "RGBA", {}),
])
def test_every_mode_is_reduced_as_rgb(fmt, mode, save):
    image = Image.fromarray(gradient(1024, 768)).convert("L" if mode == "I;16" else mode)
    if mode == "I;16":
        image = Image.fromarray(np.asarray(image, np.uint16) * 257)
    decoded = decode_image(encode_image(image, fmt, **save), LIMIT, SHAPES)
    expected = (384, 512, 3) if fmt == "JPEG" else (256, 342, 3)  # 768 // 256 = 3: the JPEG decoder's 1/2, or 1/3
    assert decoded.pixels.dtype == np.uint8 and decoded.pixels.shape == expected
    assert (decoded.width, decoded.height) == (1024, 768)


def test_small_images_are_decoded_exactly_as_without_a_working_size():
    pixels = np.random.default_rng(0).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    for data in (encode(pixels, "PNG"), encode(pixels, "JPEG", quality=90)):
        np.testing.assert_array_equal(decode_image(data, LIMIT, SHAPES).pixels, decode_image(data, LIMIT).pixels)


def test_the_pixel_limit_is_still_checked_from_the_header_first():
    data = encode(gradient(800, 600), "JPEG")
    with pytest.raises(ImageTooLarge, match="800x600 = 480000 pixels, over the limit of 400000"):
        decode_image(data, 400_000, SHAPES)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 700), st.integers(1, 700), st.integers(1, 300), st.integers(1, 300),
       st.sampled_from(["JPEG", "PNG"]), st.sampled_from([1, 6]))
def test_any_decoding_covers_the_working_size_or_keeps_the_whole_image(width, height, need_w, need_h, fmt,
                                                                         orientation):
    size = WorkingSize(width=need_w, height=need_h)
    data = encode(gradient(width, height), fmt, orientation=orientation)
    decoded = decode_image(data, LIMIT, size)
    shown = (height, width) if orientation == 6 else (width, height)
    assert (decoded.width, decoded.height) == shown
    rows, columns = decoded.pixels.shape[:2]
    assert (columns, rows) == shown or (columns >= need_w and rows >= need_h)
    assert columns <= shown[0] and rows <= shown[1]
