"""The work every peer does per image, as this service does it: decode the JPEG, run the model, answer boxes.

Imported by each peer's adapter inside that peer's own virtual environment: it needs only TensorFlow,
NumPy and Pillow, never the project. The model is a TF Object Detection API SavedModel taking uint8
[B, H, W, 3] pixels (`input_tensor`); it resizes to its own input size inside its graph, so the pixels go
in as decoded (640x480 JPEGs are decoded at full size by this service too: no model here needs fewer).
Answers are those of this service's `/detect`: boxes in pixels, score at least 0.5, best first.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

THRESHOLD = 0.5  # the service's default_threshold
MAX_DETECTIONS = 100


def version_folder(path: str) -> Path:
    """Return the highest numbered version under a base path, or the path itself if it holds the model."""
    folder = Path(path)
    if (folder / "saved_model.pb").exists():
        return folder
    versions = sorted((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return versions[-1]


class Model:
    """A loaded SavedModel's serving signature; `answer` may be called from any one thread at a time."""

    def __init__(self, path: str):
        import tensorflow as tf

        self._tf = tf
        self._loaded = tf.saved_model.load(str(version_folder(path)))  # keeps the variables alive
        self._signature = self._loaded.signatures["serving_default"]
        self._input = next(iter(self._signature.structured_input_signature[1]))
        self.answer([_blank_jpeg()])  # the first call traces; not a request's cost

    def answer(self, jpegs: list[bytes]) -> list[str]:
        """Decode the images, run them (one call per run of same-sized images), return one JSON answer each."""
        images = [decode(data) for data in jpegs]
        answers: list[str] = [""] * len(images)
        groups: dict[tuple, list[int]] = {}
        for i, image in enumerate(images):
            groups.setdefault(image.shape, []).append(i)
        for positions in groups.values():
            batch = np.stack([images[i] for i in positions])
            outputs = self._signature(**{self._input: self._tf.convert_to_tensor(batch)})
            arrays = {k: outputs[k].numpy() for k in ("detection_boxes", "detection_classes", "detection_scores",
                                                       "num_detections")}
            for row, i in enumerate(positions):
                height, width = images[i].shape[:2]
                answers[i] = json.dumps({"width": width, "height": height,
                                         "detections": detections(arrays, row, width, height)})
        return answers


def decode(data: bytes) -> np.ndarray:
    """Decode an image file into upright RGB uint8 pixels [H, W, 3], as the service's decoder does."""
    from PIL import ImageOps

    with Image.open(io.BytesIO(data)) as image:
        image = ImageOps.exif_transpose(image)
        return np.asarray(image.convert("RGB"))


def detections(arrays: dict, row: int, width: int, height: int) -> list[dict]:
    """One image's detections above the threshold, best first, boxes in pixels (the service's JSON)."""
    count = int(arrays["num_detections"][row])
    scores = arrays["detection_scores"][row][:count].astype(np.float64)
    found = []
    for i in np.argsort(-scores, kind="stable"):
        if scores[i] < THRESHOLD or len(found) >= MAX_DETECTIONS:
            break
        y_min, x_min, y_max, x_max = np.clip(arrays["detection_boxes"][row][i].astype(np.float64), 0.0, 1.0)
        found.append({"class_id": int(np.rint(arrays["detection_classes"][row][i])), "score": round(float(scores[i]), 4),
                      "box": {"x_min": round(x_min * width, 1), "y_min": round(y_min * height, 1),
                              "x_max": round(x_max * width, 1), "y_max": round(y_max * height, 1)}})
    return found


def _blank_jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (640, 480), (127, 127, 127)).save(buffer, format="JPEG")
    return buffer.getvalue()
