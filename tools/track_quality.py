"""Tracking quality on generated sequences with known trajectories: MOTA and IDF1 (py-motmetrics).

Starts a server on the committed models, encodes each sequence of tools/sequences.py as an MP4, posts it to
/models/<model>/detect/video and scores the NDJSON answer's tracks against the truth: the shapes sequences
(shapes moving, crossing and hiding one another) on `shapes`, the slow pan and zoom across
samples/astronaut.jpg on `objects`, where the person must keep one identity from the first frame to the
last. A truth box and a track box are the same object at IoU 0.5 or more; an object less than 40% in view
is left out of the truth, and a track box on it is not counted against the tracker (as MOTChallenge leaves
out what is mostly hidden).

It also runs the project's tracker offline on the same frames' raw detections (each frame posted to /detect
at threshold 0.1), once with its greedy matching and once with the Hungarian algorithm (scipy's
linear_sum_assignment, as ByteTrack does), and with detections matched across classes, to show what each
choice is worth; and the detector alone (every detection its own identity) as the floor.

    .venv/bin/python -m tools.track_quality [--seeds 5] [--frames 150] [--out out/track_quality.json]
        [--plot docs/tracking-shapes.png]
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from tools import ROOT
from tools.sequences import MIN_VISIBLE, Sequence, pan_sequence, shapes_sequence, write_video

MATCH_IOU = 0.5


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(log: Path):
    """Start `python -m app serve` on the committed models, fp32, on a free port; return it once ready."""
    from tools.server import ServerProcess, write_settings

    config = log.with_suffix(".toml")
    write_settings(config, {"model_repository": str(ROOT / "models"), "spare_workers": 0, "precision": "fp32",
                            "idle_unload_s": 0.0, "max_video_bytes": "512MiB"})
    return ServerProcess.start(config, log)


def post(port: int, path: str, body: bytes, content_type: str, timeout_s: float = 600.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def tracks_from_server(port: int, model: str, sequence: Sequence, scratch: Path) -> list[list[tuple]]:
    """Post the sequence as an MP4; return per frame the tracks the server answered: (track_id, box)."""
    video = write_video(sequence, scratch / f"{sequence.name}.mp4")
    status, body = post(port, f"/models/{model}/detect/video", video.read_bytes(), "video/mp4")
    if status != 200:
        raise SystemExit(f"{model} answered {status}: {body[:300]!r}")
    records = [json.loads(line) for line in body.splitlines() if line.strip()]
    if "error" in records[-1]:
        raise SystemExit(f"{model}'s video ended with an error: {records[-1]}")
    frames = [r for r in records if "frame" in r]
    if len(frames) != len(sequence.frames):
        raise SystemExit(f"{model} answered {len(frames)} frames of {len(sequence.frames)}")
    return [[(d["track_id"], _box(d)) for d in r["detections"] if d["track_id"] is not None] for r in frames]


def raw_detections(port: int, model: str, sequence: Sequence) -> list[list[tuple]]:
    """Each frame posted alone as a PNG at threshold 0.1: (box, score, class_id) per detection."""
    from PIL import Image

    found = []
    for pixels in sequence.frames:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "PNG", compress_level=1)
        status, body = post(port, f"/models/{model}/detect?threshold=0.1&max_detections=1000", buffer.getvalue(),
                            "image/png")
        if status != 200:
            raise SystemExit(f"{model} answered {status}: {body[:300]!r}")
        found.append([(_box(d), d["score"], d["class_id"]) for d in json.loads(body)["detections"]])
    return found


def offline_tracks(detections: list[list[tuple]], fps: float, assign=None, by_class: bool = True,
                   high: float = 0.5) -> list[list[tuple]]:
    """Run app/vision/tracking.py's Tracker over raw detections, as the server does; (track_id, box) per frame."""
    from app.vision.tracking import Tracker

    tracker = Tracker(high=high, fps=fps, assign=assign)
    out = []
    for frame in detections:
        boxes = np.array([d[0] for d in frame], np.float64).reshape(-1, 4)
        scores = np.array([d[1] for d in frame], np.float64)
        classes = np.array([d[2] if by_class else 0 for d in frame])
        tracked = tracker.update(boxes, scores, classes)
        out.append([(t.track_id, tuple(boxes[t.index])) for t in tracked if t.track_id is not None])
    return out


def detector_alone(detections: list[list[tuple]], high: float = 0.5) -> list[list[tuple]]:
    """The floor: every detection at or above `high` a new identity."""
    next_id, out = 1, []
    for frame in detections:
        row = []
        for box, score, _ in frame:
            if score >= high:
                row.append((next_id, box))
                next_id += 1
        out.append(row)
    return out


def hungarian(similarity: np.ndarray, least: float) -> list[tuple[int, int]]:
    """ByteTrack's own matching: the assignment of greatest total similarity (scipy), pairs at least `least`."""
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(-similarity)
    return [(int(r), int(c)) for r, c in zip(rows, cols) if similarity[r, c] >= least]


def score(sequence: Sequence, tracks: list[list[tuple]]) -> dict:
    """MOTA, IDF1 and the rest of py-motmetrics' summary for one sequence's tracks against its truth."""
    import motmetrics

    from app.vision.tracking import iou_matrix

    accumulator = motmetrics.MOTAccumulator(auto_id=True)
    for truth, hypotheses in zip(sequence.truth, tracks):
        shown = [t for t in truth if t.visible >= MIN_VISIBLE]
        hidden = [t for t in truth if t.visible < MIN_VISIBLE]
        if hidden and hypotheses:  # a track box on an object mostly out of sight counts neither way
            overlap = iou_matrix(np.array([h[1] for h in hypotheses]), np.array([t.box for t in hidden]))
            hypotheses = [h for h, row in zip(hypotheses, overlap) if row.max() < MATCH_IOU]
        iou = iou_matrix(np.array([t.box for t in shown]).reshape(-1, 4),
                         np.array([h[1] for h in hypotheses]).reshape(-1, 4))
        distance = np.where(iou >= MATCH_IOU, 1.0 - iou, np.nan)
        accumulator.update([t.object_id for t in shown], [h[0] for h in hypotheses], distance)
    metrics = motmetrics.metrics.create()
    names = ["mota", "idf1", "num_switches", "num_false_positives", "num_misses", "num_objects",
             "num_unique_objects", "mostly_tracked", "num_fragmentations"]
    summary = metrics.compute(accumulator, metrics=names, name=sequence.name)
    row = {name: float(summary[name].iloc[0]) for name in names}
    row["identities"] = len({h[0] for frame in tracks for h in frame})
    return {k: (round(v, 4) if isinstance(v, float) and not v.is_integer() else int(v)) for k, v in row.items()}


def _box(detection: dict) -> tuple:
    b = detection["box"]
    return b["x_min"], b["y_min"], b["x_max"], b["y_max"]


def _overall(rows: list[dict]) -> dict:
    """MOTA and IDF1 over several sequences, weighted by their objects (MOTA) and their frames (IDF1 as a mean)."""
    objects = sum(r["num_objects"] for r in rows)
    errors = sum(r["num_misses"] + r["num_false_positives"] + r["num_switches"] for r in rows)
    return {"mota": round(1 - errors / objects, 4) if objects else None,
            "idf1_mean": round(sum(r["idf1"] for r in rows) / len(rows), 4),
            "idf1_min": min(r["idf1"] for r in rows), "switches": sum(r["num_switches"] for r in rows)}


def plot(sequence: Sequence, tracks: list[list[tuple]], path: Path) -> None:
    """Draw which track followed each true object, frame by frame: one row per object, a colour per track."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from app.vision.tracking import iou_matrix

    objects = sorted({t.object_id for frame in sequence.truth for t in frame})
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(objects) + 1.4), dpi=110)
    colours = plt.get_cmap("tab20")
    for index, (truth, hypotheses) in enumerate(zip(sequence.truth, tracks)):
        for t in truth:
            row = objects.index(t.object_id)
            match = None
            if hypotheses:
                iou = iou_matrix(np.array([t.box]), np.array([h[1] for h in hypotheses]))[0]
                if iou.max() >= MATCH_IOU:
                    match = hypotheses[int(iou.argmax())][0]
            colour = "#dddddd" if match is None else colours(match % 20)
            ax.barh(row, 1, left=index, color=colour, height=0.7 if t.visible >= MIN_VISIBLE else 0.3)
            if match is not None and (index == 0 or _match_at(sequence, tracks, index - 1, t.object_id) != match):
                ax.text(index + 0.5, row, f"#{match}", va="center", ha="left", fontsize=8)
    ax.set_yticks(range(len(objects)), [f"object {o}" for o in objects])
    ax.set_xlabel("frame (thin: less than 40% in view; grey: no track on it)")
    ax.set_title(f"{sequence.name}: the track on each object, frame by frame")
    ax.invert_yaxis()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _match_at(sequence: Sequence, tracks, index: int, object_id: int) -> Optional[int]:
    from app.vision.tracking import iou_matrix

    truth = [t for t in sequence.truth[index] if t.object_id == object_id]
    if not truth or not tracks[index]:
        return None
    iou = iou_matrix(np.array([truth[0].box]), np.array([h[1] for h in tracks[index]]))[0]
    return tracks[index][int(iou.argmax())][0] if iou.max() >= MATCH_IOU else None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.track_quality", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="shapes sequences, seeds 0 to N-1")
    parser.add_argument("--frames", type=int, default=150, help="frames per shapes sequence (30 fps)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "track_quality.json")
    parser.add_argument("--plot", type=Path, default=None, help="draw the tracks of shapes seed 0 here (PNG)")
    args = parser.parse_args(argv)
    result = {"load_average_at_start": [round(x, 2) for x in os.getloadavg()], "shapes": {}, "pan": {}}
    with tempfile.TemporaryDirectory() as scratch_text:
        scratch = Path(scratch_text)
        server = start_server(scratch / "server.log")
        try:
            variants: dict[str, list[dict]] = {"server": [], "greedy": [], "hungarian": [], "any_class": [],
                                               "detector_alone": []}
            for seed in range(args.seeds):
                sequence = shapes_sequence(seed=seed, frames=args.frames)
                started = time.monotonic()
                served = tracks_from_server(server.port, "shapes", sequence, scratch)
                raw = raw_detections(server.port, "shapes", sequence)
                runs = {"server": served, "greedy": offline_tracks(raw, sequence.fps),
                        "hungarian": offline_tracks(raw, sequence.fps, assign=hungarian),
                        "any_class": offline_tracks(raw, sequence.fps, by_class=False),
                        "detector_alone": detector_alone(raw)}
                rows = {name: score(sequence, tracks) for name, tracks in runs.items()}
                for name, row in rows.items():
                    variants[name].append(row)
                result["shapes"][sequence.name] = rows
                print(f"{sequence.name}: server MOTA {rows['server']['mota']:.3f} IDF1 {rows['server']['idf1']:.3f} "
                      f"switches {rows['server']['num_switches']} | greedy IDF1 {rows['greedy']['idf1']:.3f} | "
                      f"hungarian IDF1 {rows['hungarian']['idf1']:.3f} | any class IDF1 "
                      f"{rows['any_class']['idf1']:.3f} ({time.monotonic() - started:.0f} s)", flush=True)
                if seed == 0 and args.plot is not None:
                    plot(sequence, served, args.plot)
            result["shapes_overall"] = {name: _overall(rows) for name, rows in variants.items()}
            pan = pan_sequence()
            served = tracks_from_server(server.port, "objects", pan, scratch)
            result["pan"] = {**score(pan, served), "frames": len(pan.frames),
                             "frames_with_the_person_tracked": sum(1 for frame in served if frame)}
            print(f"{pan.name}: MOTA {result['pan']['mota']:.3f} IDF1 {result['pan']['idf1']:.3f}, "
                  f"{result['pan']['identities']} identity(ies), the person tracked in "
                  f"{result['pan']['frames_with_the_person_tracked']} of {len(pan.frames)} frames", flush=True)
        finally:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"shapes_overall": result["shapes_overall"], "pan": result["pan"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
