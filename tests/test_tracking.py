"""ByteTrack (app/vision/tracking.py) on hand-made detections: what keeps an identity, what starts one, ends one."""

from __future__ import annotations

import numpy as np
import pytest

from app.vision.tracking import Tracker, greedy_assignment, iou_matrix


def box(x: float, y: float, size: float = 40.0) -> tuple:
    return (x, y, x + size, y + size)


def step(tracker: Tracker, detections: list[tuple]) -> dict:
    """One frame of (box, score, class); return {detection index: track id} of what the tracker answered."""
    boxes = np.array([d[0] for d in detections], np.float64).reshape(-1, 4)
    tracked = tracker.update(boxes, np.array([d[1] for d in detections]), np.array([d[2] for d in detections]))
    return {t.index: t.track_id for t in tracked}


def test_an_object_moving_steadily_keeps_one_identity():
    tracker = Tracker(high=0.5, fps=30)
    ids = {step(tracker, [(box(10 + 4 * i, 50), 0.9, 1)])[0] for i in range(60)}
    assert ids == {1}
    assert tracker.tracks_started == 1


def test_two_objects_of_other_classes_crossing_keep_their_identities():
    """Two boxes swap places through each other, fully overlapping midway: the class keeps them apart."""
    tracker = Tracker(high=0.5, fps=30)
    seen = []
    for i in range(41):
        answer = step(tracker, [(box(10 + 5 * i, 50), 0.9, 1), (box(210 - 5 * i, 50), 0.8, 2)])
        seen.append((answer[0], answer[1]))
    assert set(seen) == {(1, 2)}


def test_an_object_whose_class_flips_for_a_few_frames_keeps_its_identity():
    """The detector calls a square a circle for three frames as it passes behind something: the same box, moving on,
    is the same object; a track prefers its own class, but another class only halves the match."""
    tracker = Tracker(high=0.5, fps=30)
    classes = [1] * 10 + [2] * 3 + [1] * 10
    ids = {step(tracker, [(box(10 + 4 * i, 50), 0.9, c)])[0] for i, c in enumerate(classes)}
    assert ids == {1} and tracker.tracks_started == 1


def test_two_objects_of_one_class_crossing_keep_their_identities_by_motion():
    """Same class, paths crossing at an angle: the Kalman filter's prediction carries each through."""
    tracker = Tracker(high=0.5, fps=30)
    first = {}
    for i in range(40):
        answer = step(tracker, [(box(10 + 6 * i, 10 + 3 * i), 0.9, 1), (box(10 + 6 * i, 130 - 3 * i), 0.9, 1)])
        if i == 0:
            first = answer
        assert answer == first, f"frame {i}"


def test_an_unsure_detection_keeps_a_track_alive_but_never_starts_one():
    """ByteTrack's second stage: a half-hidden object's score drops below `high`; its track goes on with it."""
    tracker = Tracker(high=0.5, fps=30)
    for i in range(5):
        assert step(tracker, [(box(10 + 3 * i, 50), 0.9, 1)]) == {0: 1}
    for i in range(5, 15):
        assert step(tracker, [(box(10 + 3 * i, 50), 0.2, 1)]) == {0: 1}  # answered, with its identity
    assert step(tracker, [(box(200, 150), 0.3, 1)]) == {}  # alone and unsure: not answered, no track
    assert tracker.tracks_started == 1
    assert step(tracker, [(box(10, 150), 0.05, 1)]) == {}  # below `low`: not even matched


def test_a_track_lost_for_less_than_a_second_is_found_again_and_after_that_a_new_one_starts():
    tracker = Tracker(high=0.5, fps=10)  # lost for 10 frames at most
    for i in range(5):
        step(tracker, [(box(10 + 2 * i, 50), 0.9, 1)])
    for _ in range(6):
        assert step(tracker, []) == {}
    assert step(tracker, [(box(22, 50), 0.9, 1)]) == {0: 1}
    for _ in range(12):
        step(tracker, [])
    assert step(tracker, [(box(22, 50), 0.9, 1)]) == {0: None}  # a new track, unconfirmed until seen again
    assert step(tracker, [(box(22, 50), 0.9, 1)]) == {0: 2}


def test_a_new_object_after_the_first_frame_is_answered_unconfirmed_then_confirmed():
    tracker = Tracker(high=0.5, fps=30)
    assert step(tracker, [(box(10, 10), 0.9, 1)]) == {0: 1}  # the first frame confirms at once
    assert step(tracker, [(box(10, 10), 0.9, 1), (box(200, 200), 0.9, 2)]) == {0: 1, 1: None}
    assert step(tracker, [(box(10, 10), 0.9, 1), (box(201, 200), 0.9, 2)]) == {0: 1, 1: 2}
    # one seen once and never again is dropped, and its number is not reused
    step(tracker, [(box(10, 10), 0.9, 1), (box(100, 300), 0.9, 3)])
    step(tracker, [(box(10, 10), 0.9, 1)])
    assert step(tracker, [(box(10, 10), 0.9, 1), (box(300, 10), 0.9, 3)]) == {0: 1, 1: None}
    assert step(tracker, [(box(10, 10), 0.9, 1), (box(300, 10), 0.9, 3)]) == {0: 1, 1: 4}


def test_sure_detections_just_over_the_threshold_are_answered_but_start_no_track():
    """ByteTrack starts tracks only at high + 0.1; a detection between is answered without an identity."""
    tracker = Tracker(high=0.5, fps=30)
    assert step(tracker, [(box(10, 10), 0.55, 1)]) == {0: None}
    assert tracker.tracks_started == 0


def test_trackers_share_nothing():
    one, two = Tracker(), Tracker()
    step(one, [(box(10, 10), 0.9, 1)])
    step(one, [(box(10, 10), 0.9, 1), (box(100, 100), 0.9, 1)])
    assert step(two, [(box(100, 100), 0.9, 1)]) == {0: 1}


def test_greedy_assignment_takes_the_best_pairs_first_and_respects_the_bound():
    similarity = np.array([[0.9, 0.8], [0.85, 0.1], [0.0, 0.15]])
    assert greedy_assignment(similarity, 0.2) == [(0, 0)]  # row 1's best is taken; row 2 is under the bound
    assert sorted(greedy_assignment(similarity, 0.1)) == [(0, 0), (2, 1)]
    assert greedy_assignment(np.zeros((0, 3)), 0.2) == []


@pytest.mark.parametrize("a, b, expected", [
    ((0, 0, 10, 10), (0, 0, 10, 10), 1.0),
    ((0, 0, 10, 10), (5, 0, 15, 10), 1 / 3),
    ((0, 0, 10, 10), (20, 20, 30, 30), 0.0),
    ((0, 0, 0, 0), (0, 0, 0, 0), 0.0),
])
def test_iou_matrix(a, b, expected):
    assert iou_matrix(np.array([a]), np.array([b]))[0, 0] == pytest.approx(expected)
