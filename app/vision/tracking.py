"""ByteTrack: object identities across a video's frames, from detections alone (Zhang et al., ECCV 2022).

Each track has a Kalman filter over its box (centre, aspect ratio, height and their velocities, as in
ByteTrack and DeepSORT). Each frame, every track's box is predicted, then matched to detections by IoU
in two stages: the sure detections (score at least `high`) against every track, then the unsure ones
(from `low` up to `high`) against the tracks still unmatched, so that an object half hidden, whose
score drops, keeps its identity instead of losing it. A track unmatched for `lost_frames` frames ends;
a sure detection left unmatched starts a track, which is confirmed when it is matched again in the next
frame (at once in the first frame). A track prefers detections of its own class: one of another class
counts for half (CROSS_CLASS), so an object whose class the detector flips for a few frames keeps its number.

Matching is greedy, highest similarity first, not the Hungarian algorithm ByteTrack calls: its IoU
matrices are sparse (an object overlaps few predicted boxes), and tools/track_quality.py measures the
two on the generated sequences (docs/measured.md#tracking). So the `video` extra needs no scipy.

A Tracker belongs to one video request and is used by one thread; nothing is shared between trackers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

# ByteTrack's defaults (its track_thresh 0.5, det_thresh track_thresh + 0.1, match_thresh 0.8 on fused
# distance, 0.5 in the second stage, 0.7 for unconfirmed tracks, track_buffer 30 frames at 30 fps).
LOW = 0.1
NEW_TRACK_MARGIN = 0.1
FIRST_IOU = 0.2  # stage 1: IoU x score at least this (ByteTrack's 1 - match_thresh)
SECOND_IOU = 0.5  # stage 2: IoU at least this, scores not fused
UNCONFIRMED_IOU = 0.3
LOST_S = 1.0
# A detection of another class may continue a track at half the similarity: the same object, its class flipped by
# the detector for a few frames as it hides behind another, keeps its number, while a track still prefers its own
# class. Measured on tools/track_quality.py's five shapes sequences: IDF1 0.922 mean and 0.829 at worst with a
# strict class gate (0), 0.913 and 0.864 across classes (1), 0.935 and 0.877 at 0.5.
CROSS_CLASS = 0.5  # a track unmatched this long ends

_WEIGHT_POSITION = 1.0 / 20  # the Kalman filter's noise, relative to the box height (DeepSORT's)
_WEIGHT_VELOCITY = 1.0 / 160
_MOTION = np.eye(8)
_MOTION[:4, 4:] = np.eye(4)  # constant velocity, one step per frame
_OBSERVE = np.eye(4, 8)

# Pairs rows (tracks) with columns (detections) of a similarity matrix, each pair at least the bound given.
Assign = Callable[[np.ndarray, float], list[tuple[int, int]]]


@dataclass(frozen=True)
class TrackedDetection:
    """A detection of this frame and the identity the tracker gave it (None: a track not yet confirmed)."""

    index: int  # position in the frame's detections
    track_id: Optional[int]


class _Track:
    """One object's identity: its Kalman state, class and how long it has been unmatched."""

    def __init__(self, track_id: int, box: np.ndarray, class_id: int, frame: int, confirmed: bool):
        self.track_id = track_id
        self.class_id = class_id
        self.mean, self.covariance = _initiate(_xyah(box))
        self.last_frame = frame
        self.confirmed = confirmed
        self.lost = False

    def predict(self) -> None:
        if self.lost:
            self.mean[7] = 0.0  # a lost object's height is held, as ByteTrack does
        height = self.mean[3]
        std = np.array([_WEIGHT_POSITION * height, _WEIGHT_POSITION * height, 1e-2, _WEIGHT_POSITION * height,
                        _WEIGHT_VELOCITY * height, _WEIGHT_VELOCITY * height, 1e-5, _WEIGHT_VELOCITY * height])
        self.mean = _MOTION @ self.mean
        self.covariance = _MOTION @ self.covariance @ _MOTION.T + np.diag(std * std)

    def update(self, box: np.ndarray, frame: int) -> None:
        height = self.mean[3]
        std = np.array([_WEIGHT_POSITION * height, _WEIGHT_POSITION * height, 1e-1, _WEIGHT_POSITION * height])
        projected = _OBSERVE @ self.mean
        innovation_cov = _OBSERVE @ self.covariance @ _OBSERVE.T + np.diag(std * std)
        gain = np.linalg.solve(innovation_cov, _OBSERVE @ self.covariance).T
        self.mean = self.mean + gain @ (_xyah(box) - projected)
        self.covariance = self.covariance - gain @ innovation_cov @ gain.T
        self.last_frame = frame
        self.lost = False

    def box(self) -> np.ndarray:
        """The predicted box, x_min, y_min, x_max, y_max."""
        cx, cy, aspect, height = self.mean[:4]
        width = aspect * height
        return np.array([cx - width / 2, cy - height / 2, cx + width / 2, cy + height / 2])


class Tracker:
    """ByteTrack over one video's frames; `update` once per frame, in order. Not thread-safe: one per video."""

    def __init__(self, high: float = 0.5, fps: float = 30.0, low: float = LOW, assign: Optional[Assign] = None):
        self._assign = assign or greedy_assignment  # tools/track_quality.py compares the Hungarian algorithm
        self.high = high
        self.low = min(low, high)
        self.new_track = min(high + NEW_TRACK_MARGIN, 1.0)
        self.lost_frames = max(1, round(LOST_S * fps))
        self._tracks: list[_Track] = []
        self._frame = 0
        self._next_id = 1

    @property
    def tracks_started(self) -> int:
        """How many identities this video has had."""
        return self._next_id - 1

    def update(self, boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray) -> list[TrackedDetection]:
        """Take one frame's detections (boxes [N, 4] x_min, y_min, x_max, y_max; scores; classes); return those
        that are tracked or sure: every detection of score at least `high`, and those from `low` up that
        continue a confirmed track, each with its track's id."""
        self._frame += 1
        frame = self._frame
        boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        scores = np.asarray(scores, dtype=np.float64).reshape(-1)
        classes = np.asarray(classes).reshape(-1)
        high = [i for i in range(len(scores)) if scores[i] >= self.high]
        low = [i for i in range(len(scores)) if self.low <= scores[i] < self.high]
        for track in self._tracks:
            track.predict()
        confirmed = [t for t in self._tracks if t.confirmed]
        unconfirmed = [t for t in self._tracks if not t.confirmed]
        given: dict[int, int] = {}  # detection index -> track id

        # Stage 1: sure detections against every confirmed track, lost ones included.
        pairs, free_tracks, free_high = _match(confirmed, high, boxes, scores, classes, FIRST_IOU, True, self._assign)
        for track, index in pairs:
            track.update(boxes[index], frame)
            given[index] = track.track_id
        # Stage 2: unsure detections against the tracks followed until the last frame and unmatched so far.
        followed = [t for t in free_tracks if not t.lost]
        pairs, unmatched, _ = _match(followed, low, boxes, scores, classes, SECOND_IOU, False, self._assign)
        for track, index in pairs:
            track.update(boxes[index], frame)
            given[index] = track.track_id
        for track in unmatched:
            track.lost = True
        # Tracks started in the last frame: confirmed by a sure detection now, else dropped.
        pairs, dropped, free_high = _match(unconfirmed, free_high, boxes, scores, classes, UNCONFIRMED_IOU, True,
                                             self._assign)
        for track, index in pairs:
            track.update(boxes[index], frame)
            track.confirmed = True
            given[index] = track.track_id
        gone = {id(t) for t in dropped}
        gone.update(id(t) for t in self._tracks if t.lost and frame - t.last_frame > self.lost_frames)
        self._tracks = [t for t in self._tracks if id(t) not in gone]
        # New tracks from the sure detections left over.
        for index in free_high:
            if scores[index] >= self.new_track:
                track = _Track(self._next_id, boxes[index], int(classes[index]), frame, confirmed=frame == 1)
                self._next_id += 1
                self._tracks.append(track)
                if track.confirmed:
                    given[index] = track.track_id
        return [TrackedDetection(i, given.get(i)) for i in range(len(scores)) if i in given or scores[i] >= self.high]


def _match(tracks: list[_Track], detections: list[int], boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray,
           least: float, fuse: bool, assign: Assign) -> tuple[list[tuple[_Track, int]], list[_Track], list[int]]:
    """Pair tracks with detections by `assign` on their similarity (IoU, times the score if `fuse`, times CROSS_CLASS
    across classes), each pair at least `least`; return the pairs, the tracks left and the detections left (in
    order)."""
    if not tracks or not detections:
        return [], list(tracks), list(detections)
    predicted = np.stack([t.box() for t in tracks])
    similarity = iou_matrix(predicted, boxes[detections])
    if fuse:
        similarity = similarity * scores[detections][None, :]
    track_classes = np.array([t.class_id for t in tracks])
    similarity[track_classes[:, None] != classes[detections][None, :]] *= CROSS_CLASS
    chosen = assign(similarity, least)
    taken_rows, taken_cols = {row for row, _ in chosen}, {col for _, col in chosen}
    pairs = [(tracks[row], detections[col]) for row, col in chosen]
    left_tracks = [t for i, t in enumerate(tracks) if i not in taken_rows]
    left_detections = [d for j, d in enumerate(detections) if j not in taken_cols]
    return pairs, left_tracks, left_detections


def greedy_assignment(similarity: np.ndarray, least: float) -> list[tuple[int, int]]:
    """Pair rows with columns, highest similarity first, each pair at least `least`: (row, column) pairs."""
    rows, cols = np.nonzero(similarity >= least)
    order = np.argsort(-similarity[rows, cols], kind="stable")
    taken_rows, taken_cols, pairs = set(), set(), []
    for k in order:
        row, col = int(rows[k]), int(cols[k])
        if row not in taken_rows and col not in taken_cols:
            taken_rows.add(row)
            taken_cols.add(col)
            pairs.append((row, col))
    return pairs


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of `a` [N, 4] with every box of `b` [M, 4] (x_min, y_min, x_max, y_max): [N, M]."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 4)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 4)
    width = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    height = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = width * height
    area_a = np.clip(a[:, 2] - a[:, 0], 0, None) * np.clip(a[:, 3] - a[:, 1], 0, None)
    area_b = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def _xyah(box: np.ndarray) -> np.ndarray:
    width, height = max(box[2] - box[0], 1e-3), max(box[3] - box[1], 1e-3)
    return np.array([box[0] + width / 2, box[1] + height / 2, width / height, height])


def _initiate(measurement: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    height = measurement[3]
    std = np.array([2 * _WEIGHT_POSITION * height, 2 * _WEIGHT_POSITION * height, 1e-2, 2 * _WEIGHT_POSITION * height,
                    10 * _WEIGHT_VELOCITY * height, 10 * _WEIGHT_VELOCITY * height, 1e-5,
                    10 * _WEIGHT_VELOCITY * height])
    return np.concatenate([measurement, np.zeros(4)]), np.diag(std * std)
