"""Encode a scene's boxes as the networks' training targets: the locator's after TTFNet, the classifier's crops.

Heatmap: per class, an elliptical Gaussian around each object's centre cell (sigma = ALPHA x box
side / 6), 1 exactly at that cell. Box targets: the object's box, at the cells inside the box
where a second, narrower Gaussian (BETA) is high; each object's cell weights sum to log(area), so
big objects count a little more than small ones but not in proportion to their size. Where objects
overlap, the smaller one owns the cells.

Crops: each object's box, jittered as the locator's boxes will be off, labelled with its class;
and a few boxes on the background, labelled 0, so the classifier can veto the locator's mistakes.
"""

from __future__ import annotations

import math

import numpy as np

ALPHA = 0.54
BETA = 0.54


def encode(boxes: np.ndarray, classes: np.ndarray, grid: int, stride: int, num_classes: int):
    """Return (heatmap [G, G, C], box target [G, G, 4], box weight [G, G]) for one image.

    `boxes` are [N, 4] normalized ymin, xmin, ymax, xmax; `classes` 1-based. Box targets are
    x_min, y_min, x_max, y_max in input px (the grid's size times the stride).
    """
    size = grid * stride
    heat = np.zeros((grid, grid, num_classes), np.float32)
    target = np.zeros((grid, grid, 4), np.float32)
    weight = np.zeros((grid, grid), np.float32)
    if len(boxes) == 0:
        return heat, target, weight
    px = np.stack([boxes[:, 1], boxes[:, 0], boxes[:, 3], boxes[:, 2]], axis=1) * size  # x0, y0, x1, y1
    areas = (px[:, 2] - px[:, 0]) * (px[:, 3] - px[:, 1])
    centres = (np.arange(grid, dtype=np.float32) + 0.5) * stride
    for i in np.argsort(-areas, kind="stable"):  # largest first: smaller objects overwrite
        x0, y0, x1, y1 = px[i]
        w, h = max(x1 - x0, 1.0), max(y1 - y0, 1.0)
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        col = min(int(cx // stride), grid - 1)
        row = min(int(cy // stride), grid - 1)
        peak_x, peak_y = centres[col], centres[row]
        gx = _gaussian_1d(centres, peak_x, ALPHA * w / 6)
        gy = _gaussian_1d(centres, peak_y, ALPHA * h / 6)
        channel = heat[:, :, classes[i] - 1]
        np.maximum(channel, gy[:, None] * gx[None, :], out=channel)

        bx = _gaussian_1d(centres, peak_x, BETA * w / 6) * (np.abs(centres - peak_x) <= BETA * w / 2)
        by = _gaussian_1d(centres, peak_y, BETA * h / 6) * (np.abs(centres - peak_y) <= BETA * h / 2)
        inside_x = (centres >= x0) & (centres <= x1)
        inside_y = (centres >= y0) & (centres <= y1)
        g = (by * inside_y)[:, None] * (bx * inside_x)[None, :]
        g[row, col] = max(g[row, col], 1.0)  # the centre cell always learns the box
        cells = g > 0
        target[cells] = px[i]
        weight[cells] = g[cells] / g.sum() * math.log(max(w * h, 2.0))
    return heat, target, weight


def _gaussian_1d(centres: np.ndarray, peak: float, sigma: float) -> np.ndarray:
    sigma = max(sigma, 0.3)
    g = np.exp(-((centres - peak) ** 2) / (2 * sigma * sigma))
    g[g < 1e-4] = 0.0
    return g.astype(np.float32)


POSITIVE_CROPS = 8  # at most this many objects per scene teach the classifier per step
NEGATIVE_CROPS = 2
CROP_SLOTS = POSITIVE_CROPS + NEGATIVE_CROPS
JITTER = 0.1  # centre shift, as a share of the box side
SCALE_JITTER = 0.15  # log of the side's scale factor, at most


def sample_crops(boxes: np.ndarray, classes: np.ndarray, rng: np.random.Generator):
    """Return (crop boxes [CROP_SLOTS, 4] normalized ymin, xmin, ymax, xmax, labels [CROP_SLOTS]).

    Labels are the class (1-based) for objects, 0 for background boxes, -1 for unused slots.
    """
    crops = np.zeros((CROP_SLOTS, 4), np.float32)
    labels = np.full(CROP_SLOTS, -1, np.int32)
    chosen = rng.permutation(len(boxes))[:POSITIVE_CROPS]
    for slot, i in enumerate(chosen):
        y0, x0, y1, x1 = boxes[i]
        h, w = y1 - y0, x1 - x0
        cy, cx = (y0 + y1) / 2 + rng.uniform(-JITTER, JITTER) * h, (x0 + x1) / 2 + rng.uniform(-JITTER, JITTER) * w
        h, w = h * np.exp(rng.uniform(-SCALE_JITTER, SCALE_JITTER)), w * np.exp(rng.uniform(-SCALE_JITTER, SCALE_JITTER))
        crops[slot] = (cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2)
        labels[slot] = classes[i]
    slot = len(chosen)
    for _ in range(10 * NEGATIVE_CROPS):
        if slot >= CROP_SLOTS:
            break
        h, w = np.exp(rng.uniform(np.log(0.04), np.log(0.5), size=2))
        y0, x0 = rng.uniform(0, 1 - h), rng.uniform(0, 1 - w)
        candidate = np.array([y0, x0, y0 + h, x0 + w], np.float32)
        if len(boxes) == 0 or _iou(candidate, boxes).max() < 0.3:
            crops[slot], labels[slot] = candidate, 0
            slot += 1
    return crops, labels


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    y0, x0 = np.maximum(box[0], boxes[:, 0]), np.maximum(box[1], boxes[:, 1])
    y1, x1 = np.minimum(box[2], boxes[:, 2]), np.minimum(box[3], boxes[:, 3])
    overlap = np.clip(y1 - y0, 0, None) * np.clip(x1 - x0, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    return overlap / (area + areas - overlap)
