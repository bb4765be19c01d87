"""Score a detector on the fixed held-out scenes with pycocotools' COCOeval.

`coco_map` is the scoring function alone: ground truth and predictions in, mAP@0.5 and
mAP@[0.5:0.95] out, so it can be checked on predictions made from the ground truth itself.
`evaluate_model` runs an exported model through `app.detector.load_detector` on the held-out
scenes and writes `metrics.json` beside it.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, TextIO

import numpy as np

from .data import CLASSES, HELDOUT_SEED, Scene, heldout_scenes
from .progress import ProgressBar

METRICS_FILE = "metrics.json"


@dataclass(frozen=True)
class Prediction:
    """One image's detections in pixels."""

    boxes: np.ndarray  # [N, 4] x_min, y_min, x_max, y_max
    classes: np.ndarray  # [N] 1-based
    scores: np.ndarray  # [N]

    @classmethod
    def from_scene(cls, shot: Scene) -> "Prediction":
        """Return the ground truth of a scene as a perfect prediction, every score 1."""
        return cls(shot.boxes, shot.classes, np.ones(len(shot.classes), np.float32))

    @classmethod
    def empty(cls) -> "Prediction":
        return cls(np.zeros((0, 4), np.float32), np.zeros(0, np.int32), np.zeros(0, np.float32))


def coco_map(scenes: Sequence[Scene], predictions: Sequence[Prediction]) -> dict:
    """Return {'map_50', 'map_50_95'} of predictions against the scenes' ground truth, by COCOeval."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    if len(scenes) != len(predictions):
        raise ValueError(f"{len(scenes)} scenes but {len(predictions)} predictions")
    images = [{"id": i, "height": s.image.shape[0], "width": s.image.shape[1]} for i, s in enumerate(scenes)]
    categories = [{"id": i, "name": name} for i, name in enumerate(CLASSES, 1)]
    truth = _annotations(images, [(s.boxes, s.classes, None) for s in scenes])
    found = _annotations(images, [(p.boxes, p.classes, p.scores) for p in predictions])
    quiet = io.StringIO()  # COCO and COCOeval print their progress to stdout
    with contextlib.redirect_stdout(quiet):
        gt = _coco(COCO, images, categories, truth)
        dt = _coco(COCO, images, categories, found)
        evaluator = COCOeval(gt, dt, iouType="bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats = evaluator.stats
    # COCOeval reports -1 where no category has ground truth; that is no score at all, not a bad one.
    return {"map_50_95": max(float(stats[0]), 0.0), "map_50": max(float(stats[1]), 0.0)}


def _annotations(images: list[dict], per_image) -> list[dict]:
    annotations = []
    for image, (boxes, classes, scores) in zip(images, per_image):
        for k, (box, class_id) in enumerate(zip(np.asarray(boxes, np.float64), classes)):
            x0, y0, x1, y1 = (float(v) for v in box)
            entry = {
                "id": len(annotations) + 1, "image_id": image["id"], "category_id": int(class_id),
                "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0), "iscrowd": 0,
            }
            if scores is not None:
                entry["score"] = float(scores[k])
            annotations.append(entry)
    return annotations


def _coco(coco_class, images, categories, annotations):
    coco = coco_class()
    coco.dataset = {"images": images, "categories": categories, "annotations": annotations}
    coco.createIndex()
    return coco


def predict(detector, scenes: Sequence[Scene], stream: Optional[TextIO] = None) -> list[Prediction]:
    """Run a loaded `app.inference.detector.Detector` on each scene, one image per call, showing progress."""
    bar = ProgressBar(len(scenes), "evaluate", stream=stream if stream is not None else sys.stderr)
    predictions = []
    started = time.perf_counter()
    for i, shot in enumerate(scenes, 1):
        out = detector.infer([shot.image])[0].trimmed()
        height, width = shot.image.shape[:2]
        y0, x0, y1, x1 = (np.clip(out.boxes.astype(np.float64), 0.0, 1.0).T if len(out.boxes) else np.zeros((4, 0)))
        boxes = np.stack([x0 * width, y0 * height, x1 * width, y1 * height], axis=1)
        predictions.append(Prediction(boxes, np.rint(out.classes).astype(np.int64), out.scores.astype(np.float64)))
        bar.update(i, img_s=round(i / (time.perf_counter() - started), 1))
    return predictions


def evaluate_model(model_path: Path, count: int = 500, seed: int = HELDOUT_SEED,
                   stream: Optional[TextIO] = None) -> dict:
    """Score the model at `model_path` on `count` held-out scenes; write and return its metrics."""
    from ..inference.detector import load_detector

    detector = load_detector(model_path)
    scenes = heldout_scenes(count, seed)
    started = time.perf_counter()
    predictions = predict(detector, scenes, stream)
    seconds = time.perf_counter() - started
    metrics = {
        **coco_map(scenes, predictions),
        "images": count,
        "objects": int(sum(len(s.classes) for s in scenes)),
        "heldout_seed": seed,
        "model": str(detector.model.path),
        "seconds_per_image": round(seconds / max(count, 1), 4),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "evaluator": "pycocotools COCOeval, iouType bbox, maxDets 100",
    }
    metrics["latency_640x480_ms"] = single_image_latency(detector, scenes[0].image)
    metrics["size_bytes"] = folder_size(Path(detector.model.path))
    path = Path(detector.model.path) / METRICS_FILE
    path.write_text(json.dumps(metrics, indent=2) + "\n")
    return {**metrics, "path": str(path)}


def single_image_latency(detector, image: np.ndarray, runs: int = 50, warmup: int = 5) -> dict:
    """Time the model alone on `image` resized to 640x480, batch 1, after warm-up; return p50/p90 in ms."""
    from PIL import Image

    frame = np.asarray(Image.fromarray(image).resize((640, 480), Image.BILINEAR))
    for _ in range(warmup):
        detector.infer([frame])
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        detector.infer([frame])
        times.append((time.perf_counter() - started) * 1000.0)
    return {"p50": round(float(np.percentile(times, 50)), 2), "p90": round(float(np.percentile(times, 90)), 2),
            "runs": runs}


def folder_size(folder: Path) -> int:
    """Bytes on disk of the model under `folder`: every file but the metrics this module writes."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.name != METRICS_FILE)
