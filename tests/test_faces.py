"""The committed face detector (models/faces, exported by tools/export/faces.py) against mtcnn itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.inference.detector import load_detector

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "faces"
THRESHOLD = 0.8  # mtcnn's threshold_onet: detect_faces returns the faces scored above it
MAX_DETECTIONS = 100  # the export pads its outputs to this many
# The photos shipped in scikit-image's data and the faces in each, by eye.
FACES_IN = {"astronaut": 1, "camera": 1, "coffee": 0, "chelsea": 0, "rocket": 0, "hubble_deep_field": 0}


def rgb(image: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.stack([image] * 3, axis=-1) if image.ndim == 2 else image[..., :3])


def lfw_mosaic(count: int = 8, columns: int = 4) -> np.ndarray:
    """Tile scikit-image's 25x25 LFW faces, 4x enlarged, on grey: many faces in one image."""
    import skimage.data

    faces = [np.repeat(np.repeat((face * 255).astype(np.uint8), 4, 0), 4, 1)
             for face in skimage.data.lfw_subset()[:count]]
    rows = [np.concatenate(faces[r:r + columns], axis=1) for r in range(0, count, columns)]
    return rgb(np.pad(np.concatenate(rows, axis=0), 16, constant_values=128))


@pytest.fixture(scope="module")
def photos() -> dict[str, np.ndarray]:
    import skimage.data

    found = {name: rgb(getattr(skimage.data, name)()) for name in FACES_IN}
    found["lfw_mosaic"] = lfw_mosaic()
    return found


@pytest.fixture(scope="module")
def faces():
    return load_detector(MODEL)


@pytest.fixture(scope="module")
def serving(faces):
    """The export's serving_default signature, called directly rather than through the Detector."""
    import tensorflow as tf

    return tf.saved_model.load(str(faces.model.path)).signatures["serving_default"]


@pytest.fixture(scope="module")
def package_answers(photos) -> dict[str, list[tuple[np.ndarray, float]]]:
    """mtcnn's own detect_faces on every photo, once: [(x1, y1, x2, y2 in pixels, confidence)]."""
    mtcnn = pytest.importorskip("mtcnn")
    detector = mtcnn.MTCNN()
    answers = {}
    for name, image in photos.items():
        found = detector.detect_faces(image)  # the package's defaults: boxes as rounded x, y, width, height
        answers[name] = [(np.array(f["box"][:2] + [f["box"][0] + f["box"][2], f["box"][1] + f["box"][3]], float),
                          float(f["confidence"])) for f in found]
    return answers


@pytest.fixture(scope="module")
def model_answers(faces, photos) -> dict[str, list[tuple[np.ndarray, float]]]:
    answers = {}
    for name, image in photos.items():
        found = faces.detect([image], THRESHOLD, MAX_DETECTIONS)[0]
        answers[name] = [(np.array([d.box.x_min, d.box.y_min, d.box.x_max, d.box.y_max]), d.score) for d in found]
    return answers


def iou(a: np.ndarray, b: np.ndarray) -> float:
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def pairs(ours, theirs):
    """Match each of the package's faces to our best-overlapping one."""
    return [(max(ours, key=lambda o: iou(o[0], t[0])), t) for t in theirs]


PHOTO_NAMES = [*FACES_IN, "lfw_mosaic"]


@pytest.mark.parametrize("name", PHOTO_NAMES)
def test_finds_as_many_faces_as_mtcnn(name, model_answers, package_answers):
    assert len(model_answers[name]) == len(package_answers[name])
    if name in FACES_IN:
        assert len(model_answers[name]) == FACES_IN[name]


def test_the_mosaic_holds_many_faces(package_answers):
    """The LFW mosaic is there to exercise NMS and more than one output; it must hold several faces."""
    assert len(package_answers["lfw_mosaic"]) >= 5


@pytest.mark.parametrize("name", PHOTO_NAMES)
def test_boxes_overlap_mtcnn_boxes_and_scores_agree(name, model_answers, package_answers):
    assert len(model_answers[name]) == len(package_answers[name])
    for (box, score), (their_box, their_score) in pairs(model_answers[name], package_answers[name]):
        assert iou(box, their_box) >= 0.8
        assert score == pytest.approx(their_score, abs=0.02)


def test_the_signature_follows_the_od_api_contract(faces, serving):
    assert (faces.input_name, faces.input_dtype, faces.input_shape) == ("input_tensor", "uint8", (None, None, None, 3))
    assert faces.labels == {1: "face"}
    outputs = serving.structured_outputs
    assert {k: (v.dtype.name, v.shape.as_list()) for k, v in outputs.items()} == {
        "detection_boxes": ("float32", [None, MAX_DETECTIONS, 4]),
        "detection_classes": ("float32", [None, MAX_DETECTIONS]),
        "detection_scores": ("float32", [None, MAX_DETECTIONS]),
        "num_detections": ("float32", [None]),
    }


def test_outputs_are_padded_with_zeros_and_every_class_is_face(serving, photos):
    import tensorflow as tf

    out = {k: v.numpy() for k, v in serving(input_tensor=tf.constant(photos["astronaut"][None])).items()}
    assert out["num_detections"].tolist() == [1.0]
    assert out["detection_scores"][0, 0] > THRESHOLD and not out["detection_scores"][0, 1:].any()
    assert not out["detection_boxes"][0, 1:].any()
    assert (out["detection_classes"] == 1.0).all()
    y_min, x_min, y_max, x_max = out["detection_boxes"][0, 0]
    assert 0 <= y_min < y_max <= 1 and 0 <= x_min < x_max <= 1


def test_each_image_in_a_batch_gets_its_own_answer(faces, photos):
    """Astronaut and coffee cut to the same 400x512 in one call: one face and none, as when alone."""
    astronaut, coffee = photos["astronaut"][:400, :512], photos["coffee"][:, :512]
    alone = [faces.run(image[None])[0].trimmed() for image in (astronaut, coffee)]
    assert [len(a.scores) for a in alone] == [1, 0]
    for batch, expected in (((astronaut, coffee), alone), ((coffee, astronaut), alone[::-1])):
        together = [t.trimmed() for t in faces.run(np.stack(batch))]
        assert [len(t.scores) for t in together] == [len(e.scores) for e in expected]
        for t, e in zip(together, expected):
            np.testing.assert_allclose(t.boxes, e.boxes, atol=1e-5)
            np.testing.assert_allclose(t.scores, e.scores, atol=1e-5)


@pytest.mark.parametrize("height, width", [(1, 1), (11, 11), (19, 19), (12, 400), (400, 12)])
def test_images_too_small_for_the_pyramid_have_no_faces(faces, height, width):
    image = np.full((height, width, 3), 128, np.uint8)
    assert faces.detect([image], 0.0, MAX_DETECTIONS) == [[]]


@pytest.mark.parametrize("pixel", [0, 128, 255])
def test_a_blank_image_with_no_face_candidates_answers_no_faces(faces, pixel):
    """No P-Net proposal: R-Net and O-Net are skipped, not run on an empty batch (which oneDNN mis-shapes)."""
    image = np.full((480, 640, 3), pixel, np.uint8)
    assert faces.detect([image, image], 0.0, MAX_DETECTIONS) == [[], []]


def test_the_export_is_small():
    size = sum(f.stat().st_size for f in (MODEL / "1").rglob("*") if f.is_file())
    assert size < 5e6


def test_the_model_runs_without_mtcnn_lz4_or_joblib():
    """A fresh process where importing mtcnn, lz4 or joblib fails still loads and runs the export."""
    code = (
        "import sys\n"
        "for name in ('mtcnn', 'lz4', 'joblib'):\n"
        "    sys.modules[name] = None\n"
        "import numpy as np, skimage.data\n"
        "from app.inference.detector import load_detector\n"
        f"found = load_detector({str(MODEL)!r}).detect([skimage.data.astronaut()], {THRESHOLD}, 10)[0]\n"
        "print('faces:', [(d.label, round(d.score, 3)) for d in found])\n"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "faces: [('face', 0.999)]" in done.stdout
