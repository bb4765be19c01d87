"""A model's raw outputs for one image, and the detections the HTTP answers are made of. No TensorFlow.

The Object Detection API's outputs are normalized boxes `[ymin, xmin, ymax, xmax]`, 1-based classes
and scores, padded to a fixed number per image, of which `num_detections` are real. The worker sends
them as the model gives them; the HTTP process turns them into labelled boxes in pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from .labels import label_for

OUTPUT_NAMES = ("detection_boxes", "detection_classes", "detection_scores", "num_detections")
MAX_DETECTIONS_LIMIT = 1000  # the most detections an answer may be asked for
DEFAULT_MAX_DETECTIONS = 100


@dataclass(frozen=True)
class Box:
    """A box in pixels of the image as the user sees it."""

    x_min: float
    y_min: float
    x_max: float
    y_max: float


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes (0 where both are empty)."""
    width = max(0.0, min(a.x_max, b.x_max) - max(a.x_min, b.x_min))
    height = max(0.0, min(a.y_max, b.y_max) - max(a.y_min, b.y_min))
    inter = width * height
    union = (a.x_max - a.x_min) * (a.y_max - a.y_min) + (b.x_max - b.x_min) * (b.y_max - b.y_min) - inter
    return inter / union if union > 0 else 0.0


@dataclass(frozen=True)
class Detection:
    """One detected object."""

    label: str
    class_id: int
    score: float
    box: Box

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "class_id": self.class_id,
            "score": round(self.score, 4),
            "box": {k: round(v, 1) for k, v in vars(self.box).items()},
        }


@dataclass(frozen=True)
class ModelOutputs:
    """One image's outputs as the model gives them, padding included; the first `count` are real."""

    boxes: np.ndarray  # [K, 4] float32, normalized ymin, xmin, ymax, xmax
    classes: np.ndarray  # [K] float32, 1-based
    scores: np.ndarray  # [K] float32
    count: int  # num_detections, at most K
    version: Optional[str] = None  # the model version that gave them, where it is known

    @property
    def padded(self) -> int:
        return int(self.scores.shape[0])

    def trimmed(self) -> "ModelOutputs":
        """Return the real detections only: the first `count`, without the padding."""
        n = self.count
        return replace(self, boxes=self.boxes[:n], classes=self.classes[:n], scores=self.scores[:n])


def stack_outputs(outputs: Sequence[ModelOutputs]) -> dict[str, np.ndarray]:
    """Stack images' outputs into the batch arrays the contract names, padding K to the largest."""
    width = max((o.padded for o in outputs), default=0)
    n = len(outputs)
    boxes = np.zeros((n, width, 4), np.float32)
    classes = np.zeros((n, width), np.float32)
    scores = np.zeros((n, width), np.float32)
    counts = np.zeros((n,), np.float32)
    for i, out in enumerate(outputs):
        k = out.padded
        boxes[i, :k], classes[i, :k], scores[i, :k], counts[i] = out.boxes, out.classes, out.scores, out.count
    return {"detection_boxes": boxes, "detection_classes": classes, "detection_scores": scores,
            "num_detections": counts}


def unstack_outputs(arrays: dict[str, np.ndarray]) -> list[ModelOutputs]:
    """Split the contract's batch arrays into one ModelOutputs per image (views, no copies)."""
    boxes, classes = arrays["detection_boxes"], arrays["detection_classes"]
    scores, counts = arrays["detection_scores"], arrays["num_detections"].reshape(-1)
    return [
        ModelOutputs(boxes=boxes[i], classes=classes[i], scores=scores[i],
                     count=int(min(max(counts[i], 0), scores.shape[1])))
        for i in range(boxes.shape[0])
    ]


def to_detections(out: ModelOutputs, width: int, height: int, labels: dict[int, str],
                  threshold: float, max_detections: int) -> list[Detection]:
    """Turn one image's outputs into pixel-space detections above threshold, best first."""
    scores = out.scores[:out.count].astype(np.float64)
    order = np.argsort(-scores, kind="stable")
    detections = []
    for i in order:
        score = float(scores[i])
        if score < threshold or len(detections) >= max_detections:
            break
        y_min, x_min, y_max, x_max = np.clip(out.boxes[i].astype(np.float64), 0.0, 1.0)
        class_id = int(np.rint(out.classes[i]))
        detections.append(Detection(
            label=label_for(labels, class_id),
            class_id=class_id,
            score=score,
            box=Box(x_min=float(x_min * width), y_min=float(y_min * height),
                    x_max=float(x_max * width), y_max=float(y_max * height)),
        ))
    return detections
