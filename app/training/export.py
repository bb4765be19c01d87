"""Export a trained shapes network as a SavedModel honouring the OD API serving contract.

The graph takes uint8 images [B, H, W, 3] of any size and batch, resizes them to the locator's
square input (aspect ratio not kept: boxes come back normalized to the original image), runs the
locator with batch norms folded in, keeps objectness peaks with a 3x3 max-pool (the NMS), decodes
the best PEAKS boxes per image, crops each from the original image for the classifier, and scores
every box for every class as objectness x class probability; the best MAX_DETECTIONS of those
come out. Beside `saved_model.pb` go `label_map.pbtxt` and `model_info.json`, which declares the
locator's native input size.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import tensorflow as tf

from ..inference.parity import add_reference_photos
from .data import CLASSES, heldout_scenes
from .model import CROP_SIZE, NetConfig, box_distances, cell_centres, crop_objects, fold, preprocess
from .train import load_net

PEAKS = 20  # boxes per image the classifier looks at; scenes hold at most 10 objects
MAX_DETECTIONS = 80  # PEAKS x 4 classes
MIN_SCORE = 0.01  # num_detections counts the outputs scored at least this; the rest is padding
INFO_FILE = "model_info.json"
REFERENCE_SCENES = 3  # the parity gate's photos: the first held-out scenes, about 20 shapes in all


class ShapesDetector(tf.Module):
    """The serving graph around a folded network."""

    def __init__(self, net, name="shapes_detector"):
        super().__init__(name=name)
        self.net = net
        self.config: NetConfig = net.config

    @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8, name="input_tensor")])
    def detect(self, input_tensor):
        config = self.config
        grid, classes, size = config.grid, config.classes, config.input_size
        heat_logits, raw = self.net.locator(preprocess(input_tensor, size), training=False)
        heat = tf.sigmoid(heat_logits)[..., 0]
        peaks = tf.where(tf.equal(heat, tf.nn.max_pool2d(heat[..., None], 3, 1, "SAME")[..., 0]),
                         heat, tf.zeros_like(heat))
        batch = tf.shape(input_tensor)[0]
        objectness, cell = tf.math.top_k(tf.reshape(peaks, [batch, grid * grid]), k=PEAKS)
        distances = box_distances(tf.gather(tf.reshape(raw, [batch, grid * grid, 4]), cell, batch_dims=1),
                                  config.box_scale)
        centres = tf.gather(tf.reshape(cell_centres(config), [grid * grid, 2]), cell)
        corners = tf.concat([centres - distances[..., :2], centres + distances[..., 2:]], axis=-1) / size
        x0, y0, x1, y1 = tf.unstack(tf.clip_by_value(corners, 0.0, 1.0), axis=-1)
        boxes = tf.stack([y0, x0, y1, x1], axis=-1)  # [B, PEAKS, 4]

        owners = tf.repeat(tf.range(batch), PEAKS)
        crops = crop_objects(input_tensor, tf.reshape(boxes, [-1, 4]), owners)
        probabilities = tf.nn.softmax(self.net.classifier(crops, training=False))[:, 1:]  # drop 'no shape'
        scores = objectness[..., None] * tf.reshape(probabilities, [batch, PEAKS, classes])
        best, index = tf.math.top_k(tf.reshape(scores, [batch, PEAKS * classes]), k=MAX_DETECTIONS)
        return {
            "detection_boxes": tf.gather(boxes, index // classes, batch_dims=1),
            "detection_classes": tf.cast(index % classes + 1, tf.float32),
            "detection_scores": best,
            "num_detections": tf.reduce_sum(tf.cast(best >= MIN_SCORE, tf.float32), axis=1),
        }


def label_map_text() -> str:
    """Return the label map in the OD API's text format."""
    items = [f"item {{ id: {i} name: '{name}' display_name: '{name}' }}" for i, name in enumerate(CLASSES, 1)]
    return "\n".join(items) + "\n"


def next_version(base: Path) -> Path:
    """Return base/<highest numeric version + 1>, or base/1."""
    versions = [int(p.name) for p in Path(base).glob("*") if p.is_dir() and re.fullmatch(r"\d+", p.name)]
    return Path(base) / str(max(versions, default=0) + 1)


def export(checkpoint_dir: Path, out: Path) -> Path:
    """Write the SavedModel, label map and model info for the latest checkpoint to `out`; return `out`."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; pick another --out")
    net, step = load_net(checkpoint_dir)
    detector = ShapesDetector(fold(net))
    tf.saved_model.save(detector, str(out), signatures={"serving_default": detector.detect})
    (out / "label_map.pbtxt").write_text(label_map_text())
    config = net.config
    info = {
        "input_size": {"height": config.input_size, "width": config.input_size},
        "resize": "bilinear with antialiasing to the input size, aspect ratio not kept",
        "classifier_crop_size": {"height": CROP_SIZE, "width": CROP_SIZE},
        "output_stride": config.stride,
        "max_detections": MAX_DETECTIONS,
        "classes": list(CLASSES),
        "trained_steps": step,
        "network": config.to_json(),
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    add_reference_photos(out, reference_jpegs())
    return out


def reference_jpegs() -> dict[str, bytes]:
    """The first held-out scenes as JPEG quality 90: the first one is samples/scene.jpg."""
    import io

    from PIL import Image

    photos = {}
    for index, held_out in enumerate(heldout_scenes(REFERENCE_SCENES)):
        buffer = io.BytesIO()
        Image.fromarray(held_out.image).save(buffer, format="JPEG", quality=90, optimize=True)
        photos[f"heldout-{index}.jpg"] = buffer.getvalue()
    return photos
