"""Export mtcnn's pretrained face detector (P-Net, R-Net, O-Net) as one OD API SavedModel.

    .venv/bin/python -m tools.export.faces [--out models/faces/1]

Only the weights come from the `mtcnn` package (1.0.0, MIT; stored with joblib + lz4). The cascade
is rebuilt here in TensorFlow ops and follows `MTCNN().detect_faces` step by step, with its
defaults: the same pyramid, thresholds, box regression, squaring and crops, and the same NMS,
which is mtcnn's own "fast" variant (a box goes if any better-scored box overlaps it, kept or
not), union overlap in the first two stages and min overlap in the last. The SavedModel needs
neither mtcnn, joblib nor lz4 to run.

Serving signature `serving_default`: `input_tensor` uint8 [batch, height, width, 3], any size,
each image answered on its own; outputs `detection_boxes` (normalized [ymin, xmin, ymax, xmax]),
`detection_classes` (1.0, 'face'), `detection_scores` (O-Net's face probability; only faces above
mtcnn's 0.8 are returned, as the package does) and `num_detections`, padded to MAX_DETECTIONS.
Landmarks are not exported. Beside the SavedModel, `model_info.json` gives the working size the
service decodes photos at (app/inference/working_size.py): a longest side of WORKING_LONGEST_SIDE.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from app.inference.parity import add_reference_photos
from tools import ROOT
from tools.export import reference_jpegs

DEFAULT_OUT = ROOT / "models" / "faces" / "1"
LABEL_MAP = "item { id: 1 name: 'face' display_name: 'face' }\n"
MAX_DETECTIONS = 100
# The parity gate's photos (app/inference/parity.py): two faces, and a cat in which none may appear.
REFERENCE_PHOTOS = ("astronaut", "camera", "chelsea")

# mtcnn 1.0.0's defaults (StagePNet, StageRNet, StageONet keyword arguments).
MIN_FACE_SIZE = 20
MIN_SIZE = 12  # P-Net's window, in pixels of the scaled image
SCALE_FACTOR = 0.709
THRESHOLD_PNET, NMS_PNET_PER_SCALE, NMS_PNET_ACROSS_SCALES = 0.6, 0.5, 0.7
THRESHOLD_RNET, NMS_RNET = 0.7, 0.7
THRESHOLD_ONET, NMS_ONET = 0.8, 0.7
NMS_CHUNK = 512  # columns of the overlap matrix held at once: bounds memory on busy, large images

# The cascade finds faces of MIN_FACE_SIZE px and more in the image it is given. Photos are decoded
# with a longest side of at least this (Full HD's): the smallest face found is then about 1% of the
# photo's longest side (40 px in a 4032x3024 one, a face some 14 m away with a phone's main camera),
# and P-Net's pyramid, which costs in proportion to the pixels, runs on a quarter of a 12 MP photo's.
# They are scaled only by whole powers of SCALE_FACTOR (0.709^2 = 0.503 for a 12 MP photo), so that
# the pyramid visits the same scales of the photo as at full size: answers stay the full-size ones.
WORKING_LONGEST_SIDE = 1920

# Each network as mtcnn lays it out: a trunk of conv+PReLU layers and max pools, then heads.
# Weights come in this order: per conv kernel, bias, PReLU alpha; per head kernel, bias.
NETWORKS = {
    "pnet": {"trunk": ("conv", ("pool", 2, "SAME"), "conv", "conv"), "dense": False,
             "heads": ("box", "face")},
    "rnet": {"trunk": ("conv", ("pool", 3, "SAME"), "conv", ("pool", 3, "VALID"), "conv"), "dense": True,
             "heads": ("box", "face")},
    "onet": {"trunk": ("conv", ("pool", 3, "SAME"), "conv", ("pool", 3, "VALID"), "conv", ("pool", 2, "SAME"),
                       "conv"), "dense": True,
             "heads": ("box", "landmarks", "face")},
}


def step(message: str) -> None:
    print(f"[export_faces] {message}", flush=True)


def load_package_weights() -> dict[str, list[np.ndarray]]:
    """Read the three weight lists that mtcnn ships in mtcnn/assets/weights/<net>.lz4."""
    import importlib.resources

    import joblib  # mtcnn's own loader; the .lz4 files need the lz4 package to decompress

    folder = importlib.resources.files("mtcnn") / "assets" / "weights"
    return {name: [np.asarray(a, dtype=np.float32) for a in joblib.load(str(folder / f"{name}.lz4"))]
            for name in NETWORKS}


def build_detector(weights: dict[str, list[np.ndarray]]):
    """Return the tf.Module whose `detect` is the whole cascade."""
    import tensorflow as tf

    def prelu(x, alpha):
        # Keras's PReLU term for term, so the layers agree with the package's to the last bit
        return tf.nn.relu(x) - alpha * tf.nn.relu(-x)

    class Network(tf.Module):
        """One MTCNN network rebuilt from mtcnn's weight list; call returns {head: tensor}."""

        def __init__(self, name: str, arrays: list[np.ndarray]):
            super().__init__(name=name)
            spec = NETWORKS[name]
            self._spec = spec
            left = list(arrays)

            def take(count):
                return [tf.Variable(left.pop(0), trainable=False) for _ in range(count)]

            self.convs = [take(3) for layer in spec["trunk"] if layer == "conv"]
            self.dense = take(3) if spec["dense"] else []
            self.heads = [take(2) for _ in spec["heads"]]
            if left:
                raise ValueError(f"{name}: {len(left)} weight arrays left over; the layout does not match mtcnn's")

        def __call__(self, x):
            convs = iter(self.convs)
            for layer in self._spec["trunk"]:
                if layer == "conv":
                    kernel, bias, alpha = next(convs)
                    x = prelu(tf.nn.conv2d(x, kernel, 1, "VALID") + bias, alpha)
                else:
                    _, size, padding = layer
                    x = tf.nn.max_pool2d(x, size, 2, padding)
            if self.dense:
                # mtcnn permutes to [batch, width, height, channels] before flattening (Caffe's order)
                x = tf.transpose(x, [0, 2, 1, 3])
                x = tf.reshape(x, [tf.shape(x)[0], int(np.prod(x.shape[1:]))])
                kernel, bias, alpha = self.dense
                x = prelu(tf.matmul(x, kernel) + bias, alpha)
            out = {}
            for head, (kernel, bias) in zip(self._spec["heads"], self.heads):
                y = tf.matmul(x, kernel) + bias if self.dense else tf.nn.conv2d(x, kernel, 1, "VALID") + bias
                out[head] = tf.nn.softmax(y)[..., 1] if head == "face" else y
            return out

    def order_by_score(scores):
        """Indices by score, best first; ties latest first, as mtcnn's reversed argsort gives."""
        n = tf.shape(scores)[0]
        return n - 1 - tf.argsort(tf.reverse(scores, [0]), direction="DESCENDING", stable=True)

    def overlap(a, b, use_min: bool):
        """Overlap [len(a), len(b)] of [x1, y1, x2, y2] boxes: over the union, or over the smaller area."""
        area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
        area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
        width = tf.maximum(0.0, tf.minimum(a[:, None, 2], b[None, :, 2]) - tf.maximum(a[:, None, 0], b[None, :, 0]))
        height = tf.maximum(0.0, tf.minimum(a[:, None, 3], b[None, :, 3]) - tf.maximum(a[:, None, 1], b[None, :, 1]))
        inter = width * height
        if use_min:
            return inter / tf.minimum(area_a[:, None], area_b[None, :])
        return inter / (area_a[:, None] + area_b[None, :] - inter)

    def fast_nms(boxes, scores, threshold: float, use_min: bool):
        """mtcnn's NMS on boxes sorted best first: drop each box that a better one overlaps above threshold."""
        n = tf.shape(boxes)[0]
        chunks = tf.maximum(1, (n + NMS_CHUNK - 1) // NMS_CHUNK)

        def body(c, keep):
            start = c * NMS_CHUNK
            end = tf.minimum(start + NMS_CHUNK, n)
            over = overlap(boxes[:end], boxes[start:end], use_min)
            earlier = tf.range(end)[:, None] < tf.range(start, end)[None, :]
            return c + 1, keep.write(c, tf.logical_not(tf.reduce_any(earlier & (over > threshold), axis=0)))

        keep = tf.TensorArray(tf.bool, size=chunks, infer_shape=False, element_shape=[None])
        _, keep = tf.while_loop(lambda c, _: c < chunks, body, (0, keep))
        keep = keep.concat()
        return tf.boolean_mask(boxes, keep), tf.boolean_mask(scores, keep)

    def sort_and_nms(boxes, scores, threshold: float, use_min: bool = False):
        order = order_by_score(scores)
        return fast_nms(tf.gather(boxes, order), tf.gather(scores, order), threshold, use_min)

    def to_square(boxes):
        """Grow each box's short side to its long one about the centre (mtcnn's resize_to_square)."""
        x1, y1, x2, y2 = tf.unstack(boxes, axis=1)
        w, h = x2 - x1, y2 - y1
        side = tf.maximum(w, h)
        x1 = x1 + w * 0.5 - side * 0.5
        y1 = y1 + h * 0.5 - side * 0.5
        return tf.stack([x1, y1, x1 + side, y1 + side], axis=1)

    def refine(boxes, offsets):
        """Apply R-Net/O-Net regression: offsets are in units of the box's size plus one pixel."""
        x1, y1, x2, y2 = tf.unstack(boxes, axis=1)
        w, h = x2 - x1 + 1, y2 - y1 + 1
        return boxes + offsets * tf.stack([w, h, w, h], axis=1)

    def crops(image, boxes, size: int):
        """Cut boxes out of the whole image, resized to size x size; outside the image reads as 0."""
        height = tf.cast(tf.shape(image)[0], tf.float32)
        width = tf.cast(tf.shape(image)[1], tf.float32)
        x1, y1, x2, y2 = tf.unstack(boxes, axis=1)
        # mtcnn normalizes by the size, not size - 1, and so does this
        normalized = tf.stack([y1 / height, x1 / width, y2 / height, x2 / width], axis=1)
        index = tf.zeros(tf.shape(boxes)[:1], tf.int32)
        return tf.image.crop_and_resize(image[None], normalized, index, [size, size])

    class FaceDetector(tf.Module):
        """mtcnn's cascade as one graph: P-Net over a pyramid, then R-Net and O-Net on crops."""

        def __init__(self):
            super().__init__(name="faces")
            self.pnet = Network("pnet", weights["pnet"])
            self.rnet = Network("rnet", weights["rnet"])
            self.onet = Network("onet", weights["onet"])

        def pnet_scale(self, image, scale):
            """P-Net on the image scaled by `scale`: regressed boxes in image pixels, NMS'd, best first."""
            shape = tf.cast(tf.shape(image)[:2], tf.float64)
            size = tf.cast(shape * scale, tf.int32)  # mtcnn truncates the scaled size the same way
            # Smaller than P-Net's window: no cells. mtcnn's pyramid stops before this; the guard
            # keeps the convolutions from ever seeing a negative size.
            return tf.cond(tf.reduce_min(size) < MIN_SIZE,
                           lambda: (tf.zeros([0, 4]), tf.zeros([0])),
                           lambda: self.pnet_cells(image, size, scale))

        def pnet_cells(self, image, size, scale):
            scaled = tf.image.resize(image[None], size, method="area")
            out = self.pnet(scaled)
            score = out["face"][0]
            cells = tf.where(score > THRESHOLD_PNET)  # [k, (y, x)], row-major as np.where
            offsets = tf.gather_nd(out["box"][0], cells)
            scores = tf.gather_nd(score, cells)
            y = tf.cast(cells[:, 0], tf.float32) * 2
            x = tf.cast(cells[:, 1], tf.float32) * 2
            # mtcnn's generate_bounding_box: cell (x+1 .. x+12), regressed by 11 px units, before NMS
            boxes = tf.stack([x + 1 + offsets[:, 0] * 11, y + 1 + offsets[:, 1] * 11,
                              x + 12 + offsets[:, 2] * 11, y + 12 + offsets[:, 3] * 11], axis=1)
            order = order_by_score(scores)
            boxes = tf.gather(boxes, order) / tf.cast(scale, tf.float32)
            return fast_nms(boxes, tf.gather(scores, order), NMS_PNET_PER_SCALE, use_min=False)

        def proposals(self, image):
            """Stage 1: P-Net over mtcnn's pyramid, NMS per scale and across scales, squared."""
            shape = tf.cast(tf.shape(image)[:2], tf.float64)
            min_dim = tf.reduce_min(shape)
            # mtcnn's build_scale_pyramid, including its rounding (half to even, as numpy's round)
            count = tf.round(-(tf.math.log(min_dim / MIN_SIZE) / np.log(SCALE_FACTOR) + 1))
            count = tf.cast(tf.clip_by_value(count, 0.0, 64.0), tf.int32)
            first = tf.constant(MIN_SIZE / MIN_FACE_SIZE, tf.float64)

            def body(i, boxes, scores):
                scale = first * tf.pow(tf.constant(SCALE_FACTOR, tf.float64), tf.cast(i, tf.float64))
                b, s = self.pnet_scale(image, scale)
                return i + 1, tf.concat([boxes, b], 0), tf.concat([scores, s], 0)

            _, boxes, scores = tf.while_loop(
                lambda i, *_: i < count, body, (0, tf.zeros([0, 4]), tf.zeros([0])),
                shape_invariants=(tf.TensorShape([]), tf.TensorShape([None, 4]), tf.TensorShape([None])),
            )
            boxes, scores = sort_and_nms(boxes, scores, NMS_PNET_ACROSS_SCALES)
            return to_square(boxes)

        def on_crops(self, net, image, boxes, size: int):
            """Run R-Net or O-Net on size x size crops of `boxes`; no boxes, no call: empty heads.

            oneDNN's convolution (TensorFlow's default on CPUs with AVX-512 VNNI or AMX) answers an
            empty batch with its input's shape, which the next layer cannot take; so never call it
            on none.
            """
            def run():
                out = net(crops(image, boxes, size))
                return {"box": out["box"], "face": out["face"]}

            return tf.cond(tf.shape(boxes)[0] > 0, run, lambda: {"box": tf.zeros([0, 4]), "face": tf.zeros([0])})

        def refinement(self, image, boxes):
            """Stage 2: R-Net on 24x24 crops rescores and regresses; keep > 0.7, NMS, squared."""
            out = self.on_crops(self.rnet, image, boxes, 24)
            boxes, scores = refine(boxes, out["box"]), out["face"]
            keep = scores > THRESHOLD_RNET
            boxes, scores = sort_and_nms(tf.boolean_mask(boxes, keep), tf.boolean_mask(scores, keep), NMS_RNET)
            return to_square(boxes)

        def output(self, image, boxes):
            """Stage 3: O-Net on 48x48 crops; keep > 0.8, NMS with overlap over the smaller box."""
            out = self.on_crops(self.onet, image, boxes, 48)
            boxes, scores = refine(boxes, out["box"]), out["face"]
            keep = scores > THRESHOLD_ONET
            return sort_and_nms(tf.boolean_mask(boxes, keep), tf.boolean_mask(scores, keep), NMS_ONET, use_min=True)

        def detect_one(self, pixels):
            """All three stages on one [H, W, 3] uint8 image; padded OD API outputs."""
            image = (tf.cast(pixels, tf.float32) - 127.5) / 128.0  # mtcnn's normalize_images
            boxes = self.proposals(image)
            boxes = self.refinement(image, boxes)
            boxes, scores = self.output(image, boxes)
            height = tf.cast(tf.shape(image)[0], tf.float32)
            width = tf.cast(tf.shape(image)[1], tf.float32)
            x1, y1, x2, y2 = tf.unstack(boxes, axis=1)
            # mtcnn's limit_bboxes keeps corners on pixels 0 .. size - 1
            x1, x2 = (tf.clip_by_value(v, 0.0, width - 1) / width for v in (x1, x2))
            y1, y2 = (tf.clip_by_value(v, 0.0, height - 1) / height for v in (y1, y2))
            boxes = tf.stack([y1, x1, y2, x2], axis=1)[:MAX_DETECTIONS]
            scores = scores[:MAX_DETECTIONS]
            n = tf.shape(scores)[0]
            return (tf.pad(boxes, [[0, MAX_DETECTIONS - n], [0, 0]]),
                    tf.pad(scores, [[0, MAX_DETECTIONS - n]]),
                    tf.cast(n, tf.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8, name="input_tensor")])
        def detect(self, input_tensor):
            boxes, scores, counts = tf.map_fn(
                self.detect_one, input_tensor,
                fn_output_signature=(tf.TensorSpec([MAX_DETECTIONS, 4], tf.float32),
                                     tf.TensorSpec([MAX_DETECTIONS], tf.float32),
                                     tf.TensorSpec([], tf.float32)),
            )
            return {
                "detection_boxes": boxes,
                "detection_scores": scores,
                "detection_classes": tf.ones_like(scores),
                "num_detections": counts,
            }

    return FaceDetector()


def check_against_package(detector, weights: dict[str, list[np.ndarray]]) -> None:
    """Run each rebuilt network and mtcnn's Keras one on the same random input; fail if they differ."""
    from mtcnn.network.onet import ONet
    from mtcnn.network.pnet import PNet
    from mtcnn.network.rnet import RNet

    rng = np.random.default_rng(0)
    cases = {"pnet": (PNet, (2, 37, 53, 3)), "rnet": (RNet, (5, 24, 24, 3)), "onet": (ONet, (5, 48, 48, 3))}
    for name, (keras_class, shape) in cases.items():
        keras_net = keras_class()
        keras_net.build()
        keras_net.set_weights(weights[name])
        x = rng.uniform(-1, 1, shape).astype(np.float32)
        theirs = [np.asarray(t) for t in keras_net(x)]
        ours = getattr(detector, name)(x)
        mine = [ours[head].numpy() for head in NETWORKS[name]["heads"]]
        mine[-1] = np.stack([1 - mine[-1], mine[-1]], axis=-1)  # the package returns both softmax columns
        worst = max(float(np.max(np.abs(a - b))) for a, b in zip(mine, theirs))
        step(f"  {name}: largest difference from mtcnn's own {name} is {worst:.2e}")
        if worst > 1e-4:
            raise SystemExit(f"{name} does not reproduce mtcnn's network (difference {worst})")


def save(detector, out: Path) -> None:
    """Write the SavedModel and label map to `out`, replacing an earlier export there."""
    import tensorflow as tf

    if out.exists():
        if any(out.iterdir()) and not (out / "saved_model.pb").exists():
            raise SystemExit(f"{out} holds files but no SavedModel; refusing to overwrite it")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tf.saved_model.save(detector, str(out), signatures={"serving_default": detector.detect})
    (out / "label_map.pbtxt").write_text(LABEL_MAP)
    (out / "model_info.json").write_text(json.dumps(model_info(), indent=2) + "\n")
    add_reference_photos(out, reference_jpegs(REFERENCE_PHOTOS))


def model_info() -> dict:
    """What the service reads beside the SavedModel: the working size, and what it follows from."""
    return {
        "working_size": {"longest_side": WORKING_LONGEST_SIDE, "scale_step": SCALE_FACTOR},
        "min_face_size": MIN_FACE_SIZE,
        "working_size_reason": (
            f"the cascade finds faces of {MIN_FACE_SIZE} px and more in the image it is given; at a longest side "
            f"of {WORKING_LONGEST_SIDE} px that is about 1% of the photo's longest side. Scaled by whole powers of "
            f"the pyramid's step, the photo's pyramid levels are those of the full-size photo, less the finest"
        ),
        "max_detections": MAX_DETECTIONS,
        "weights": "mtcnn 1.0.0 (P-Net, R-Net, O-Net)",
    }


def smoke_test(out: Path) -> None:
    """Reload the export and run it on two blank images: the signature must load and answer."""
    import tensorflow as tf

    serve = tf.saved_model.load(str(out)).signatures["serving_default"]
    result = serve(input_tensor=tf.zeros([2, 480, 640, 3], tf.uint8))
    shapes = {k: v.shape.as_list() for k, v in sorted(result.items())}
    step(f"  reloaded: outputs {shapes}, {result['num_detections'].numpy().tolist()} faces in blank images")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.export.faces", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"version folder to write (default {DEFAULT_OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    step("1/5 reading mtcnn's pretrained weights (joblib + lz4)")
    weights = load_package_weights()
    for name, arrays in weights.items():
        step(f"  {name}: {len(arrays)} arrays, {sum(a.size for a in arrays):,} parameters")

    step("2/5 rebuilding P-Net, R-Net and O-Net in TensorFlow ops, with the cascade around them")
    detector = build_detector(weights)

    step("3/5 checking each network against mtcnn's Keras network")
    check_against_package(detector, weights)

    step(f"4/5 tracing the cascade and saving the SavedModel to {args.out}")
    save(detector, args.out)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    step(f"  wrote {size / 1e6:.2f} MB: " + ", ".join(sorted(str(f.relative_to(args.out))
                                                         for f in args.out.rglob("*") if f.is_file())))

    step("5/5 reloading the export for a smoke test")
    smoke_test(args.out)
    step(f"done in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
