"""Phone-sized photos decoded at the model's working size answer as they do at full size.

The accuracy checks run tools/export/photo_accuracy.py's own functions on subsets sized for CI; the
figures in docs/concepts/decoding.md come from the script on the full sets. The HTTP checks start real servers with
decode_at_model_size on and off and read the answers' sizes and boxes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.inference.detector import load_detector
from tools.export import photo_accuracy

from blob_model import blob_image, build_blob_model
from conftest import ROOT, start_server
from images_for_tests import encode

SHAPES_SCENES = 20  # of the 500 held-out scenes; docs/concepts/decoding.md gives all 500
FACE_PHOTOS = ("astronaut", "camera", "lfw_mosaic_0")  # the package-checked photos; 14 in docs/concepts/decoding.md


def test_shapes_map_at_the_working_size_is_within_0_01_of_full_size():
    """Held-out scenes as 4032x3024 JPEGs: the decoder's 1/8 (504x378) scores as the full 12 MP decoding."""
    result = photo_accuracy.shapes_figures(load_detector(ROOT / "models" / "shapes"), SHAPES_SCENES)
    assert result["decoded_sizes"] == [[378, 504], [504, 378]]  # portrait and landscape scenes, at 1/8
    assert result["full"]["map_50"] >= 0.85, result  # the model still works on photos at all
    assert abs(result["map_50_difference"]) <= 0.01, result


@pytest.fixture(scope="module")
def face_answers() -> dict:
    photos = {name: pixels for name, pixels in photo_accuracy.face_photos(mosaics=1).items() if name in FACE_PHOTOS}
    return photo_accuracy.face_figures(load_detector(ROOT / "models" / "faces"), photos)["per_photo"]


@pytest.mark.parametrize("name", FACE_PHOTOS)
def test_faces_at_the_working_size_are_the_full_size_faces(face_answers, name):
    """4032x3024 decoded at 2027x1520 (0.709 squared): every face found again, IoU >= 0.9, none new.

    Marginal detections (score under 0.9, under 100 px) are exempt: a 0.5% resize of the full-size
    photo keeps or drops them too (docs/concepts/decoding.md).
    """
    photo = face_answers[name]
    working = photo["working"]
    assert photo["decoded"] == [2027, 1520]
    assert photo["full"] >= 1 and working["ious"], photo
    assert min(working["ious"]) >= 0.9, photo
    assert working["differ_beyond_marginal"] == 0, photo


# -- over HTTP ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blob_with_working_size(tmp_path_factory):
    """The blob detector with a model_info.json declaring a 64x48 input, as the shapes model declares its own."""
    version = build_blob_model(tmp_path_factory.mktemp("models") / "blobphoto" / "1")
    (version / "model_info.json").write_text(json.dumps({"input_size": {"width": 64, "height": 48}}))
    return version.parent


TRUTH = (100, 70, 330, 250)  # the red blob in a 1024x768 photo: x_min, y_min, x_max, y_max


@pytest.mark.parametrize("setting, decoded_at", [("true", "model blobphoto version 1: decoding images no larger "
                                                          "than it needs: at least 64x48"),
                                                 ("false", "at full size (decode_at_model_size is off)")])
def test_answers_are_in_pixels_of_the_original_with_the_setting_on_and_off(blob_with_working_size, tmp_path,
                                                                           setting, decoded_at):
    """On, the blob detector sees the photo reduced by 16 (64x48): its box comes back in the photo's
    pixels, off by at most one reduced pixel. Off, it sees every pixel and the box is exact."""
    pixels = blob_image(1024, 768, {1: TRUTH})
    server = start_server({"DETECT_MODEL": str(blob_with_working_size), "DETECT_DECODE_AT_MODEL_SIZE": setting},
                          tmp_path / "server.log")
    try:
        answers = [server.request("POST", "/detect", encode(pixels, fmt, orientation=orientation),
                                  {"Content-Type": f"image/{fmt.lower()}"})
                   for fmt, orientation in (("PNG", None), ("PNG", 6))]
    finally:
        assert server.stop() == 0
    assert decoded_at in server.log()
    (status, _, upright), (turned_status, _, turned) = answers
    assert status == turned_status == 200
    assert (upright["width"], upright["height"]) == (1024, 768)
    assert (turned["width"], turned["height"]) == (768, 1024)  # EXIF 6: the user sees it turned
    box = [upright["detections"][0]["box"][k] for k in ("x_min", "y_min", "x_max", "y_max")]
    # Stored as drawn, shown turned a quarter clockwise: x_shown = 768 - y (far edges exclusive), y_shown = x.
    turned_truth = (768 - TRUTH[3], TRUTH[0], 768 - TRUTH[1], TRUTH[2])
    turned_box = [turned["detections"][0]["box"][k] for k in ("x_min", "y_min", "x_max", "y_max")]
    if setting == "true":
        assert np.abs(np.subtract(box, TRUTH)).max() <= 16 and box != list(TRUTH)
        assert np.abs(np.subtract(turned_box, turned_truth)).max() <= 16
    else:
        assert box == list(TRUTH)
        assert turned_box == list(turned_truth)
