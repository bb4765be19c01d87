"""The detector on small SavedModels the tests build: the OD API contract and exactly known outputs."""

from __future__ import annotations


import numpy as np
import pytest

from app.inference.detector import load_detector
from app.errors import ModelError
from app.models.repository import resolve_model

from blob_model import blob_image, build_blob_model


def test_the_highest_numeric_version_is_served(blob_model_dir):
    model = resolve_model(blob_model_dir)
    assert (model.name, model.version) == ("blob", "2")


def test_a_version_folder_may_be_given_directly(blob_model_dir):
    model = resolve_model(blob_model_dir / "1")
    assert (model.name, model.version) == ("blob", "1")


def test_the_signature_is_read_from_the_model(detector, blob_batch1_dir):
    assert (detector.input_name, detector.input_shape, detector.max_batch) == (
        "input_tensor", (None, None, None, 3), None)
    assert load_detector(blob_batch1_dir).max_batch == 1


def test_exact_boxes_labels_and_scores_in_pixels(detector):
    image = blob_image(64, 48, {1: (10, 5, 20, 15), 3: (30, 30, 40, 40)})
    (found,) = detector.detect([image], threshold=0.1, max_detections=10)
    assert [(d.label, d.class_id, round(d.score, 3)) for d in found] == [("Red blob", 1, 0.9), ("class_3", 3, 0.3)]
    box = found[0].box
    assert (box.x_min, box.y_min, box.x_max, box.y_max) == pytest.approx((10, 5, 20, 15), abs=1e-3)


def test_boxes_are_given_in_the_size_each_image_stands_for(detector):
    """An image decoded reduced (64x48 for a 640x480 photo) answers in the photo's pixels."""
    image = blob_image(64, 48, {1: (10, 5, 20, 15)})
    (found,) = detector.detect([image], threshold=0.1, max_detections=10, sizes=[(640, 480)])
    box = found[0].box
    assert (box.x_min, box.y_min, box.x_max, box.y_max) == pytest.approx((100, 50, 200, 150), abs=1e-3)
    with pytest.raises(ValueError, match="1 images but 2 sizes"):
        detector.detect([image], threshold=0.1, max_detections=10, sizes=[(640, 480), (64, 48)])


def test_threshold_and_max_detections_cut_the_list(detector):
    image = blob_image(50, 50, {1: (0, 0, 5, 5), 2: (10, 10, 15, 15), 3: (20, 20, 25, 25)})
    assert [d.class_id for d in detector.detect([image], 0.5, 10)[0]] == [1, 2]
    assert [d.class_id for d in detector.detect([image], 0.0, 2)[0]] == [1, 2]
    assert [d.class_id for d in detector.detect([image], 0.95, 10)[0]] == []


def test_each_image_gets_its_own_answer_in_order_whatever_the_sizes(detector):
    images = [
        blob_image(40, 30, {2: (1, 2, 3, 4)}),
        blob_image(64, 48, {1: (10, 5, 20, 15)}),
        blob_image(40, 30, {3: (5, 6, 7, 8)}),
        blob_image(40, 30, {}),
    ]
    results = detector.detect(images, 0.1, 10)
    assert [[d.class_id for d in r] for r in results] == [[2], [1], [3], []]
    assert (results[2][0].box.x_min, results[2][0].box.y_max) == pytest.approx((5, 8), abs=1e-3)


def test_a_batch_one_model_is_never_fed_more_than_one_image(blob_batch1_dir):
    calls = []
    detector = load_detector(blob_batch1_dir, on_model_call=lambda n, s: calls.append(n))
    images = [blob_image(20, 20, {1: (i, i, i + 2, i + 2)}) for i in range(3)]
    results = detector.detect(images, 0.5, 10)
    assert calls == [1, 1, 1]
    assert [r[0].box.x_min for r in results] == pytest.approx([0, 1, 2], abs=1e-3)


def test_a_batch_none_model_takes_same_sized_images_in_one_call(blob_model_dir):
    calls = []
    detector = load_detector(blob_model_dir, on_model_call=lambda n, s: calls.append(n))
    detector.detect([blob_image(20, 20, {})] * 3 + [blob_image(30, 20, {})], 0.5, 10)
    assert sorted(calls) == [1, 3]


def test_warm_up_runs_one_inference(blob_model_dir):
    calls = []
    load_detector(blob_model_dir, on_model_call=lambda n, s: calls.append(n)).warm_up()
    assert calls == [1]


def test_missing_and_empty_model_folders_are_named(tmp_path):
    with pytest.raises(ModelError, match=f"model path {tmp_path / 'nope'} does not exist"):
        load_detector(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="holds no version"):
        load_detector(tmp_path / "empty")


def test_a_corrupt_saved_model_is_named(tmp_path):
    version = tmp_path / "broken" / "1"
    version.mkdir(parents=True)
    (version / "saved_model.pb").write_bytes(b"\x00not a protobuf" * 10)
    with pytest.raises(ModelError, match="cannot be loaded as a SavedModel"):
        load_detector(tmp_path / "broken")


def test_a_model_without_the_contract_outputs_is_refused(tmp_path):
    import tensorflow as tf

    class Classifier(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8)])
        def classify(self, images):
            return {"logits": tf.reduce_mean(tf.cast(images, tf.float32), axis=[1, 2])}

    module = Classifier()
    tf.saved_model.save(module, str(tmp_path / "m" / "1"), signatures={"serving_default": module.classify})
    with pytest.raises(ModelError, match="lacks the outputs detection_boxes"):
        load_detector(tmp_path / "m")


@pytest.mark.parametrize("dtype, shape", [("int32", [None, None, None, 3]), ("float64", [None, None, None, 3]),
                                          ("uint8", [None, None, None, 4]), ("string", [None, 1])])
def test_an_input_of_no_export_type_is_refused(tmp_path, dtype, shape):
    """Only the exporter's three input types load: uint8 or float32 pixels, or a [batch] string tensor."""
    import tensorflow as tf

    class OddModel(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec(shape, tf.dtypes.as_dtype(dtype), name="x")])
        def run(self, x):
            return {"detection_boxes": tf.zeros([1, 1, 4])}

    module = OddModel()
    tf.saved_model.save(module, str(tmp_path / "f" / "1"), signatures={"serving_default": module.run})
    with pytest.raises(ModelError, match="the contract is a uint8 .* or float32 .* image"):
        load_detector(tmp_path / "f")


@pytest.mark.parametrize("input_type", ["float_image_tensor", "encoded_image_string_tensor"])
def test_every_export_type_gives_the_answers_of_the_uint8_model(tmp_path, detector, input_type):
    """A float model is fed the pixels as float32, an encoded-image model the pixels re-encoded as PNG: same boxes."""
    other = load_detector(build_blob_model(tmp_path / input_type / "1", input_type=input_type))
    assert other.input_kind == input_type and other.image_shape == (None, None, None, 3)
    assert other.signature()["input"]["kind"] == input_type
    images = [blob_image(64, 48, {1: (10, 5, 20, 15), 3: (40, 30, 60, 44)}), blob_image(64, 48, {2: (1, 1, 9, 9)})]
    expected = detector.infer(images)
    for got, want in zip(other.infer(images), expected):
        assert got.count == want.count
        np.testing.assert_array_equal(got.boxes, want.boxes)
        np.testing.assert_array_equal(got.scores, want.scores)
    declared = other.signature_defs()["serving_default"]["inputs"]["input_tensor"]
    assert declared["dtype"] == {"float_image_tensor": "DT_FLOAT", "encoded_image_string_tensor": "DT_STRING"}[input_type]


def test_a_model_without_serving_default_is_refused(tmp_path, blob_model_dir):
    import tensorflow as tf

    tf.saved_model.save(tf.Module(), str(tmp_path / "bare" / "1"))
    with pytest.raises(ModelError, match="no serving_default signature"):
        load_detector(tmp_path / "bare")
