"""Answers on phone-sized photos: decoded at the model's working size against decoded at full size.

    .venv/bin/python -m tools.export.photo_accuracy [--shapes 500] [--no-faces] [--no-compare] [--out FILE]
    .venv/bin/python -m tools.export.photo_accuracy --write-photos DIR    # the face photos, for scripts/bench

Shapes: the first N held-out scenes, each upscaled to 4032x3024 (3024x4032 when portrait; the
model resizes every image to 256x256, aspect ratio not kept, so it sees what it sees of the
scene itself) and saved as JPEG quality 90. Each file is decoded twice, at full size and at the
committed model's working size, and run through the model; both sets of boxes are scored with
pycocotools against the scenes' ground truth (mAP@0.5 and mAP@[0.5:0.95]).

Faces: the photos that tests/test_faces.py checks against the mtcnn package (astronaut, camera,
coffee, chelsea, rocket, the Hubble deep field) and mosaics of LFW faces, each upscaled to cover a
phone's 4032x3024 (turned the photo's way; what overflows on the right or at the bottom is cut off)
and saved as JPEG quality 90. The faces found at the working size are matched one to one with
those found at full size (IoU at least 0.5); the IoUs are counted, and so are the faces left over
on either side and the marginal ones among them (scored under 0.9 and under 100 px). For
comparison, the same for the JPEG decoder's 1/2 without the cascade's scale step, and for the
full-size decoding resized by 0.5% (the cascade's own sensitivity to a nudge of scale).

tests/test_photos.py runs the same functions on a subset sized for CI; the figures in docs/concepts/decoding.md come
from this script on the full sets.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from app.inference.detections import box_iou
from app.inference.images import decode_image
from app.inference.working_size import WorkingSize, read_working_size
from tools import ROOT

PHONE = (4032, 3024)  # a 12 MP phone photo, landscape
MAX_PIXELS = 40_000_000
FACE_IOU = 0.9
FACE_PHOTOS = ("astronaut", "camera", "coffee", "chelsea", "rocket", "hubble_deep_field")


def jpeg(pixels: np.ndarray, size: Optional[tuple[int, int]] = None, quality: int = 90) -> bytes:
    """Encode an RGB image as a JPEG, first resized (bicubic) to `size` (width, height) if given."""
    from PIL import Image

    image = Image.fromarray(pixels)
    buffer = io.BytesIO()
    (image.resize(size, Image.BICUBIC) if size else image).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def phone_size(width: int, height: int) -> tuple[int, int]:
    """Return 4032x3024 turned the image's way (landscape where width >= height)."""
    long_side, short_side = PHONE
    return (long_side, short_side) if width >= height else (short_side, long_side)


def phone_photo(pixels: np.ndarray) -> np.ndarray:
    """Scale an RGB image to cover a phone's frame, turned its way, and crop what overflows (right, bottom)."""
    from PIL import Image

    height, width = pixels.shape[:2]
    frame_width, frame_height = phone_size(width, height)
    scale = max(frame_width / width, frame_height / height)
    size = (max(frame_width, round(width * scale)), max(frame_height, round(height * scale)))
    return np.asarray(Image.fromarray(pixels).resize(size, Image.BICUBIC))[:frame_height, :frame_width]


def detect_both(detector, data: bytes, working: WorkingSize, threshold: float) -> dict:
    """Decode `data` at full size and at `working`; return each decoding's detections and times."""
    answers = {}
    for name, size in (("full", None), ("working", working)):
        started = time.perf_counter()
        image = decode_image(data, MAX_PIXELS, size)
        decoded = time.perf_counter()
        found = detector.detect([image.pixels], threshold, 100, sizes=[(image.width, image.height)])[0]
        answers[name] = {"detections": found, "decoded": image.pixels.shape[1::-1],
                         "original": (image.width, image.height), "decode_s": decoded - started,
                         "model_s": time.perf_counter() - decoded}
    return answers


# --- shapes ----------------------------------------------------------------------------------------

def shapes_figures(detector, count: int, progress: Optional[Callable[[str], None]] = None) -> dict:
    """mAP of the shapes model on `count` held-out scenes as phone JPEGs, full size against working size."""
    from app.training.data import heldout_scenes
    from app.training.evaluate import Prediction, coco_map

    working = read_working_size(detector.model.path)
    scenes = heldout_scenes(count)
    predictions: dict[str, list] = {"full": [], "working": []}
    times: dict[str, list] = {"full": [], "working": []}
    decoded_sizes = set()
    for i, shot in enumerate(scenes, 1):
        height, width = shot.image.shape[:2]
        answers = detect_both(detector, jpeg(shot.image, phone_size(width, height)), working, threshold=0.0)
        for name, answer in answers.items():
            # Boxes come back in the photo's pixels; scaled to the scene's, they meet its ground truth
            # (IoU, and so mAP, is the same under a scaling of each axis).
            sx, sy = width / answer["original"][0], height / answer["original"][1]
            found = answer["detections"]
            boxes = np.array([[d.box.x_min * sx, d.box.y_min * sy, d.box.x_max * sx, d.box.y_max * sy]
                              for d in found]).reshape(-1, 4)
            predictions[name].append(Prediction(boxes, np.array([d.class_id for d in found]),
                                                np.array([d.score for d in found])))
            times[name].append(answer["decode_s"])
        decoded_sizes.add(answers["working"]["decoded"])
        if progress and (i % 25 == 0 or i == count):
            progress(f"shapes: {i}/{count} scenes")
    result = {"scenes": count, "objects": int(sum(len(s.classes) for s in scenes)),
              "photo_size": list(PHONE), "working_size": working.describe(),
              "decoded_sizes": sorted(list(s) for s in decoded_sizes)}
    for name in ("full", "working"):
        result[name] = {**{k: round(v, 4) for k, v in coco_map(scenes, predictions[name]).items()},
                        "decode_ms_p50": round(1000 * float(np.median(times[name])), 1)}
    result["map_50_difference"] = round(result["working"]["map_50"] - result["full"]["map_50"], 4)
    return result


# --- faces -----------------------------------------------------------------------------------------

def face_photos(mosaics: int = 1) -> dict[str, np.ndarray]:
    """The package-checked photos and `mosaics` LFW mosaics of 12 faces each, as RGB arrays."""
    import skimage.data

    photos = {}
    for name in FACE_PHOTOS:
        image = getattr(skimage.data, name)()
        photos[name] = np.ascontiguousarray(np.stack([image] * 3, -1) if image.ndim == 2 else image[..., :3])
    faces = skimage.data.lfw_subset()[:100]  # the first 100 are faces, the rest are not
    for m in range(mosaics):
        photos[f"lfw_mosaic_{m}"] = lfw_mosaic(faces[12 * m:12 * m + 12])
    return photos


def lfw_mosaic(faces: np.ndarray, columns: int = 4) -> np.ndarray:
    """Tile 25x25 LFW faces, 4x enlarged, 4 to a row on grey, as tests/test_faces.py does; 3 rows make 4:3."""
    tiles = [np.repeat(np.repeat((face * 255).astype(np.uint8), 4, 0), 4, 1) for face in faces]
    rows = [np.concatenate(tiles[r:r + columns], axis=1) for r in range(0, len(tiles), columns)]
    grey = np.pad(np.concatenate(rows, axis=0), 16, constant_values=128)
    return np.ascontiguousarray(np.stack([grey] * 3, -1))


def marginal(face) -> bool:
    """A detection the cascade itself keeps or drops on a nudge: scored under 0.9 and under 100 px across."""
    return face.score < 0.9 and max(face.box.x_max - face.box.x_min, face.box.y_max - face.box.y_min) < 100


def match_faces(full: list, other: list) -> dict:
    """Pair another decoding's faces with the full-size ones, best overlap first, one to one (IoU >= 0.5)."""
    pairs = sorted(((box_iou(f.box, o.box), i, j) for i, f in enumerate(full) for j, o in enumerate(other)),
                   reverse=True)
    paired_full, paired_other, ious = set(), set(), []
    for overlap, i, j in pairs:
        if overlap >= 0.5 and i not in paired_full and j not in paired_other:
            paired_full.add(i)
            paired_other.add(j)
            ious.append(overlap)
    missing = [f for i, f in enumerate(full) if i not in paired_full]
    new = [o for j, o in enumerate(other) if j not in paired_other]
    return {"faces": len(other), "ious": sorted(round(x, 4) for x in ious),
            "missing": [_describe(f) for f in missing], "new": [_describe(o) for o in new],
            "differ_beyond_marginal": sum(not marginal(f) for f in missing + new)}


def _describe(face) -> dict:
    box = face.box
    return {"score": round(face.score, 3), "box": [round(v) for v in (box.x_min, box.y_min, box.x_max, box.y_max)]}


def control_detect(detector, data: bytes, threshold: float, shrink: float = 0.995) -> list:
    """The full-size decoding resized by 0.5%, bicubic: how far the cascade moves on a nudge of the scale alone."""
    from PIL import Image

    image = decode_image(data, MAX_PIXELS)
    size = (round(image.width * shrink), round(image.height * shrink))
    pixels = np.asarray(Image.fromarray(image.pixels).resize(size, Image.BICUBIC))
    return detector.detect([pixels], threshold, 100, sizes=[(image.width, image.height)])[0]


def face_figures(detector, photos: dict[str, np.ndarray], compare: bool = False,
                 progress: Optional[Callable[[str], None]] = None) -> dict:
    """Faces found in each photo at phone size, at the working size (and other decodings) against full size.

    Variants: `working` (the model's working size) and, with `compare`, `half` (the JPEG decoder's 1/2
    alone, without the scale step) and `control` (the full-size decoding resized by 0.5%).
    """
    working = read_working_size(detector.model.path)
    half = WorkingSize(longest_side=working.longest_side)
    per_photo, faces_full = {}, 0
    for name, pixels in photos.items():
        data = jpeg(phone_photo(pixels))
        answers = detect_both(detector, data, working, threshold=0.5)
        full = answers["full"]["detections"]
        faces_full += len(full)
        variants = {"working": answers["working"]["detections"]}
        if compare:
            image = decode_image(data, MAX_PIXELS, half)
            variants["half"] = detector.detect([image.pixels], 0.5, 100, sizes=[(image.width, image.height)])[0]
            variants["control"] = control_detect(detector, data, 0.5)
        per_photo[name] = {"full": len(full), "decoded": list(answers["working"]["decoded"]),
                           "seconds": {k: round(a["decode_s"] + a["model_s"], 2) for k, a in answers.items()},
                           **{k: match_faces(full, found) for k, found in variants.items()}}
        if progress:
            progress(f"faces: {name}: {len(full)} at full size; " + "; ".join(
                f"{k} {v['faces']} (IoU min {min(v['ious'], default=None)}, missing {len(v['missing'])}, "
                f"new {len(v['new'])})" for k, v in per_photo[name].items() if k in variants))
    summary = {}
    for variant in per_photo[next(iter(per_photo))]:
        if variant in ("full", "decoded", "seconds"):
            continue
        ious = [x for p in per_photo.values() for x in p[variant]["ious"]]
        summary[variant] = {
            "matched": len(ious), "iou_min": min(ious, default=None),
            "iou_median": round(float(np.median(ious)), 4) if ious else None,
            "under_0_9": sum(x < FACE_IOU for x in ious),
            "missing": sum(len(p[variant]["missing"]) for p in per_photo.values()),
            "new": sum(len(p[variant]["new"]) for p in per_photo.values()),
            "differ_beyond_marginal": sum(p[variant]["differ_beyond_marginal"] for p in per_photo.values()),
        }
    return {"photos": len(per_photo), "photo_size": list(PHONE), "working_size": working.describe(),
            "faces_full": faces_full, "variants": summary, "per_photo": per_photo}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.export.photo_accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=500, help="held-out scenes to score (0: none)")
    parser.add_argument("--shapes-model", type=Path, default=ROOT / "models" / "shapes")
    parser.add_argument("--faces", action=argparse.BooleanOptionalAction, default=True, help="run the face photos")
    parser.add_argument("--faces-model", type=Path, default=ROOT / "models" / "faces")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="also run each face photo at the decoder's 1/2 alone, and at full size resized by 0.5%%")
    parser.add_argument("--mosaics", type=int, default=8, help="LFW mosaics of 12 faces (at most 8)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "photo_accuracy.json")
    parser.add_argument("--write-photos", type=Path, default=None, metavar="DIR",
                        help="only write the face photos at phone size as JPEGs to DIR (for scripts/bench --images)")
    args = parser.parse_args(argv)
    if args.write_photos is not None:
        args.write_photos.mkdir(parents=True, exist_ok=True)
        for name, pixels in face_photos(min(args.mosaics, 8)).items():
            (args.write_photos / f"{name}.jpg").write_bytes(jpeg(phone_photo(pixels)))
        print(f"wrote {args.write_photos}", file=sys.stderr)
        return 0
    from app.inference.detector import load_detector

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = {}
    if args.shapes:
        result["shapes"] = shapes_figures(load_detector(args.shapes_model), args.shapes, say)
        s = result["shapes"]
        say(f"shapes, {s['scenes']} scenes ({s['objects']} objects) as {PHONE[0]}x{PHONE[1]} JPEGs: "
            f"mAP@0.5 {s['full']['map_50']:.4f} full size, {s['working']['map_50']:.4f} at the working size "
            f"({s['working_size']}; decoded {s['decoded_sizes']}); difference {s['map_50_difference']:+.4f}; "
            f"mAP@[0.5:0.95] {s['full']['map_50_95']:.4f} / {s['working']['map_50_95']:.4f}; decode p50 "
            f"{s['full']['decode_ms_p50']} / {s['working']['decode_ms_p50']} ms")
    if args.faces:
        result["faces"] = face_figures(load_detector(args.faces_model), face_photos(min(args.mosaics, 8)),
                                       args.compare, say)
        f = result["faces"]
        say(f"faces, {f['photos']} photos at {PHONE[0]}x{PHONE[1]}: {f['faces_full']} faces at full size")
        for variant, v in f["variants"].items():
            say(f"  {variant}: {v['matched']} matched, IoU min {v['iou_min']} median {v['iou_median']}, "
                f"{v['under_0_9']} under 0.9; {v['missing']} missing, {v['new']} new "
                f"({v['differ_beyond_marginal']} of them not marginal)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
