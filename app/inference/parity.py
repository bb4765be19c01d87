"""The parity gate: a model runs at a reduced precision only where its answers on reference photos stay fp32's.

A version folder names its reference photos in `model_info.json` (`reference_photos`, paths relative
to the folder); the exporters of the shipped models write them. At load, the worker decodes them as
the server decodes a request, runs them at fp32 and then at the reduced precision, and compares the
detections (`compare`):

- the same classes above the threshold: every fp32 detection has a match of its class, and nothing
  new appears. A detection may cross the threshold, either way, as long as its score moved by no more
  than the tolerance (both runs keep what scores down to the tolerance below the threshold);
- each match's box overlaps its fp32 box by IoU >= 0.9;
- each match's score is within SCORE_TOLERANCE of its fp32 score.

Under `auto` a precision that passes must also be faster: it is timed against fp32 on a reference photo,
and kept only at MIN_SPEEDUP or more. A precision that fails, or that fails to run, is not used: the
model serves in fp32, and the log and /models say why. `parity_gate = false` skips the check, with a
warning.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from .accelerators import Hardware, apply_precision, choose_precision
from .detections import MAX_DETECTIONS_LIMIT, Detection, box_iou
from .working_size import MODEL_INFO

log = logging.getLogger(__name__)

MIN_IOU = 0.9
# bf16 keeps 8 bits of mantissa, so each rounding is within 0.4 %; through the network the scores of the
# shipped models moved by at most 0.008 at bf16 on their reference photos (docs/measured.md#precision). 0.03
# is more than three times that, and still well below what reorders an answer or drops a box a user sees.
SCORE_TOLERANCE = 0.03
# The gate looks below the service's default threshold (0.5), at the detections a request asking for a
# lower threshold gets; it uses the default threshold instead where that is lower still.
GATE_THRESHOLD = 0.3
# auto keeps a reduced precision only where it runs this much faster than fp32, timed at load on a batch of
# SPEED_BATCH copies of the first reference photo, SPEED_ROUNDS rounds of SPEED_CALLS calls of each: on this
# CPU bf16 ran faces at 0.90x (a cascade of small convolutions, where converting to bf16 costs more than it
# saves), shapes at 1.34x and objects at 1.51x (docs/measured.md#precision).
MIN_SPEEDUP = 1.05
SPEED_BATCH = 4
SPEED_ROUNDS = 3
SPEED_CALLS = 2
REFERENCE_KEY = "reference_photos"
REFERENCE_FOLDER = "reference"
FP32 = "fp32"


def add_reference_photos(version_path: Path, photos: dict[str, bytes]) -> list[str]:
    """Write photos into a version folder's reference/ and name them in its model_info.json; return the names.

    The exporters call it last, so that a model leaves them with the photos its parity gate checks.
    """
    folder = Path(version_path) / REFERENCE_FOLDER
    folder.mkdir(exist_ok=True)
    names = []
    for name, data in photos.items():
        (folder / name).write_bytes(data)
        names.append(f"{REFERENCE_FOLDER}/{name}")
    info_path = Path(version_path) / MODEL_INFO
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info[REFERENCE_KEY] = names
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return names


def reference_photos(version_path: Path) -> list[Path]:
    """Return the reference photos a version folder names in model_info.json (none where it names none)."""
    try:
        info = json.loads((Path(version_path) / MODEL_INFO).read_text())
    except (OSError, ValueError):
        return []
    names = info.get(REFERENCE_KEY) if isinstance(info, dict) else None
    if not isinstance(names, list):
        return []
    folder = Path(version_path).resolve()
    photos = []
    for name in names:
        path = (folder / str(name)).resolve()
        if path.is_relative_to(folder) and path.is_file():  # a name that leaves the folder is not read
            photos.append(path)
        else:
            log.warning("reference photo %s of %s is not a file in the version folder; skipped", name, folder)
    return photos


@dataclass
class Comparison:
    """What comparing two runs on the reference photos found."""

    photos: int = 0
    detections: int = 0  # fp32 detections above the threshold, over every photo
    matched: int = 0
    max_score_difference: float = 0.0
    min_iou: Optional[float] = None
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        out = asdict(self)
        out["max_score_difference"] = round(self.max_score_difference, 4)
        out["min_iou"] = None if self.min_iou is None else round(self.min_iou, 4)
        return out


def compare(names: Sequence[str], reference: Sequence[Sequence[Detection]], candidate: Sequence[Sequence[Detection]],
            threshold: float, min_iou: float = MIN_IOU, tolerance: float = SCORE_TOLERANCE) -> Comparison:
    """Compare the detections of each photo (reference: fp32; candidate: the reduced precision); see the module.

    Both lists hold what scored at least `threshold - tolerance`, so a detection that crosses the threshold
    within the tolerance finds its partner on the other side. Every fp32 detection claims its partner (same
    class, IoU, score); one above the threshold that finds none is a problem, and so is any candidate above
    the threshold that no fp32 detection claimed.
    """
    result = Comparison(photos=len(names))
    for name, ours, theirs in zip(names, reference, candidate):
        free = list(theirs)
        for r in sorted(ours, key=lambda d: -d.score):
            above = r.score >= threshold
            result.detections += above
            same = [c for c in free if c.class_id == r.class_id]
            best = max(same, key=lambda c: box_iou(r.box, c.box), default=None)
            overlap = 0.0 if best is None else box_iou(r.box, best.box)
            if best is not None and overlap >= min_iou and abs(best.score - r.score) <= tolerance:
                free.remove(best)
                if above or best.score >= threshold:
                    result.matched += above
                    result.max_score_difference = max(result.max_score_difference, abs(best.score - r.score))
                    result.min_iou = min(overlap, 1.0 if result.min_iou is None else result.min_iou)
            elif above:
                found = ("nothing of its class" if best is None
                         else f"at best IoU {overlap:.3f}, score {best.score:.3f}")
                result.problems.append(f"{name}: {r.label} ({r.score:.3f}) {_where(r)} became {found}")
        for c in free:
            if c.score >= threshold:
                result.problems.append(f"{name}: {c.label} ({c.score:.3f}) {_where(c)} appeared")
    if not result.detections:
        result.problems.append("the reference photos gave no detection above the threshold: nothing was compared")
    return result


def _where(d: Detection) -> str:
    return f"at [{d.box.x_min:.0f}, {d.box.y_min:.0f}, {d.box.x_max:.0f}, {d.box.y_max:.0f}]"


@dataclass(frozen=True)
class Execution:
    """How a model executes, and why: what /models, the metrics and the log say is in force."""

    precision: str  # in force: fp32, bf16 or fp16
    asked: str  # the precision setting
    gate: str  # passed, failed, skipped (parity_gate off), none (fp32: nothing to check)
    reason: str
    hardware: str
    parity: Optional[dict] = None  # the comparison of the reduced precision with fp32, where the gate ran it
    speedup: Optional[float] = None  # auto: fp32's time over the reduced precision's, on a reference photo
    carried_over: bool = False  # True: this version's choice at an earlier load in this server, applied unchecked
    # False where an error decided it (a photo that would not decode, fp32 out of memory on them, the timing
    # failing): a later load of the version checks again instead of carrying it over
    reusable: bool = True

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"{self.precision}: {self.reason}"


def carry_over(settled: dict, tf_config=None) -> Execution:
    """Apply again what an earlier load of the same version in this server settled on (after an idle unload,
    or an unload and load by request): its version files, photos and hardware are the same, and the gate and
    the timing cost seconds."""
    execution = Execution(**{**settled, "carried_over": True})
    apply_precision(execution.precision, tf_config)
    return execution


def decoded_reference(version_path: Path, max_pixels: int) -> list[tuple[str, object]]:
    """Decode a version's reference photos as a request's are decoded: (name, DecodedImage) pairs."""
    from .images import decode_image
    from .working_size import read_working_size

    working = read_working_size(Path(version_path))
    return [(path.name, decode_image(path.read_bytes(), max_pixels, working))
            for path in reference_photos(Path(version_path))]


def settle_detector(detector, asked: str, gate: bool, threshold: float, max_pixels: int, tf_config=None,
                    hardware: Optional[Hardware] = None) -> Execution:
    """Choose, check and apply a loaded detector's precision, from its own reference photos; see settle_execution.

    `threshold` is the service's default threshold, `max_pixels` its max_image_pixels: a reference photo is
    decoded as a request's photo would be.
    """
    from .accelerators import read_hardware

    hardware = hardware or read_hardware(tf_config)

    def detect(images: list, floor: float) -> list:
        return detector.detect([image.pixels for image in images], floor, MAX_DETECTIONS_LIMIT,
                               sizes=[(image.width, image.height) for image in images])

    def photos() -> list:
        return decoded_reference(detector.model.path, max_pixels)

    def seconds(images: list) -> Callable[[], float]:
        size = min(SPEED_BATCH, detector.max_batch or SPEED_BATCH)
        batch = np.stack([images[0].pixels] * size)

        def call() -> float:
            started = time.perf_counter()
            detector.run(batch)
            return time.perf_counter() - started

        return call

    return settle_execution(detect, photos, asked, gate, min(threshold, GATE_THRESHOLD), hardware, tf_config,
                            seconds)


def settle_execution(detect: Callable[[list, float], list], photos: Callable[[], Sequence[tuple[str, object]]],
                     asked: str, gate: bool, threshold: float, hardware: Hardware, tf_config=None,
                     seconds: Optional[Callable[[list], Callable[[], float]]] = None) -> Execution:
    """Choose, check and apply the precision a loaded model runs at; return what is in force.

    `photos()` decodes the reference photos ((name, image) pairs); `detect(images, floor)` runs images
    through the model and returns their detections scoring at least `floor`; `seconds(images)` gives a
    timed model call on them, with which `auto` keeps a reduced precision only where it is faster.
    Whatever fails on the way leaves the model in fp32, loaded, with the reason.
    """
    precision, why = choose_precision(asked, hardware)
    common = dict(asked=asked, hardware=hardware.describe())

    def fp32(gate_said: str, reason: str, **more) -> Execution:
        apply_precision(FP32, tf_config)
        return Execution(FP32, gate=gate_said, reason=reason, **common, **more)

    if precision == FP32:
        return fp32("none", why)
    if not gate:
        apply_precision(precision, tf_config)
        log.warning("running %s without the parity gate (parity_gate is off): its answers are not checked against "
                    "fp32", precision)
        return Execution(precision, gate="skipped", reason=f"{why}; parity gate off, not checked", **common)
    try:
        decoded = photos()
    except Exception as exc:  # a photo that will not decode, a model_info.json that will not parse
        return fp32("failed", f"{why}, but its reference photos could not be read ({type(exc).__name__}: "
                    f"{_reason(exc)}), so it serves fp32", reusable=False)
    if not decoded:
        return fp32("failed", f"{why}, but the model names no reference photos to check {precision} against fp32 "
                              f"(model_info.json's {REFERENCE_KEY}), so it serves fp32")
    names = [name for name, _ in decoded]
    images = [image for _, image in decoded]
    floor = max(0.0, threshold - SCORE_TOLERANCE)  # both runs keep what may cross the threshold within tolerance
    apply_precision(FP32, tf_config)
    try:
        reference = detect(images, floor)
    except Exception as exc:  # fp32 itself fails on them (out of memory under a small cap): nothing to compare
        return fp32("failed", f"{why}, but the reference photos failed to run in fp32 ({type(exc).__name__}: "
                              f"{_reason(exc)}), so it serves fp32", reusable=False)
    apply_precision(precision, tf_config)
    try:
        candidate = detect(images, floor)
    except Exception as exc:  # the rewrite broke the graph, or ran out of memory: it fails the gate
        return fp32("failed", f"{why}, but {precision} failed to run on the reference photos "
                              f"({type(exc).__name__}: {_reason(exc)}), so it serves fp32", reusable=False)
    comparison = compare(names, reference, candidate, threshold)
    if not comparison.passed:
        return fp32("failed", f"{why}, but the parity gate failed, so it serves fp32: {precision} changed the "
                              f"answers: {'; '.join(comparison.problems[:3])}", parity=comparison.to_json())
    passed = (f"parity gate passed on {len(names)} reference photo(s): {comparison.matched} detections, scores "
              f"within {comparison.max_score_difference:.4f}")
    speedup = None
    if asked == "auto" and seconds is not None:
        try:
            speedup = faster_by(seconds(images), precision, tf_config)
        except Exception as exc:  # a batch of SPEED_BATCH did not fit, say: auto keeps what it knows is fast
            return fp32("passed", f"{why}, whose {passed}, but timing it failed ({type(exc).__name__}: "
                                  f"{_reason(exc)}), so it serves fp32", parity=comparison.to_json(), reusable=False)
        if speedup < MIN_SPEEDUP:
            return fp32("passed", f"{why}, whose {passed}, but it ran at {speedup:.2f}x fp32's speed (auto wants "
                                  f"{MIN_SPEEDUP:g}x), so it serves fp32", parity=comparison.to_json(),
                        speedup=speedup)
        passed += f"; {speedup:.2f}x fp32's speed"
    return Execution(precision, gate="passed", parity=comparison.to_json(), speedup=speedup, **common,
                     reason=f"{why}; {passed}")


def faster_by(call: Callable[[], float], precision: str, tf_config=None) -> float:
    """fp32's time for `call` over `precision`'s, each the median of alternate rounds; leaves `precision` on.

    Alternating makes a load beside other loads (every model at boot) slow both alike.
    """
    times: dict[str, list[float]] = {FP32: [], precision: []}
    for _ in range(SPEED_ROUNDS):
        for mode in (FP32, precision):
            apply_precision(mode, tf_config)
            call()  # untimed: the switch's own cost, and at first this batch's shape, new to the model
            times[mode] += [call() for _ in range(SPEED_CALLS)]
    return round(statistics.median(times[FP32]) / statistics.median(times[precision]), 3)


def _reason(exc: Exception) -> str:
    """The line of a TensorFlow error that says what went wrong (its first lines name the node and stack)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if not line.endswith(":") and not line.startswith(("<", "[", "Detected at"))]
    return (said or lines or [type(exc).__name__])[0][:200]
