"""Parse the parts of a /detect request that do not depend on the web framework: parameters and bodies."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

from ..errors import InvalidBody, InvalidParameter, UnsupportedContentType
from ..inference.detections import DEFAULT_MAX_DETECTIONS, MAX_DETECTIONS_LIMIT
from ..protocol.bodies import decode_base64

__all__ = ["DEFAULT_MAX_DETECTIONS", "MAX_DETECTIONS_LIMIT", "decode_base64"]  # re-exported for the tests

PICTURE_FORMATS = ("jpeg", "png")  # an answer drawn on the image (app/vision/annotate.py)
MAX_SIDE_LIMIT = 8192  # the largest max_side a client may ask for (px)
RAW_IMAGE_TYPES = ("image/jpeg", "image/jpg", "image/png", "image/webp", "image/bmp", "image/x-ms-bmp", "image/gif")


@dataclass(frozen=True)
class DetectParams:
    """The query parameters of one /detect request."""

    threshold: float
    max_detections: int
    stages: bool = False  # timing=stages: timing_ms also says where the time went, stage by stage
    picture: Optional[str] = None  # "jpeg" or "png": answer the image with its boxes drawn; None: JSON
    max_side: int = 0  # the picture's longest side at most this (px); 0: the image's own size


def parse_params(args, default_threshold: float, accepted: str = "json") -> DetectParams:
    """Parse `threshold` (0..1), `max_detections` (1..1000), `timing` (stages), `format` (json, jpeg, png; else
    `accepted`, what the Accept header prefers) and `max_side` from a mapping of query strings."""
    unknown = sorted(set(args) - {"threshold", "max_detections", "timing", "format", "max_side"})
    if unknown:
        raise InvalidParameter(f"unknown query parameter {unknown[0]!r}; /detect takes threshold, max_detections, "
                               "timing, format and max_side")
    timing = args.get("timing")
    if timing not in (None, "stages"):
        raise InvalidParameter(f"timing must be 'stages' (timing_ms then breaks the time down by stage), not "
                               f"{timing[:40]!r}")
    kind = args.get("format", accepted)
    if kind not in ("json", *PICTURE_FORMATS):
        raise InvalidParameter(f"format must be json, jpeg or png (the image with its boxes drawn), not {kind[:40]!r}")
    picture = None if kind == "json" else kind
    max_side = parse_whole(args.get("max_side"), "max_side", 16, MAX_SIDE_LIMIT, default=0)
    if max_side and picture is None:
        raise InvalidParameter("max_side sizes the picture of an answer drawn on the image: ask for format=jpeg or "
                               "png (or Accept: image/jpeg)")
    return DetectParams(
        threshold=parse_threshold(args.get("threshold"), default_threshold),
        max_detections=parse_max_detections(args.get("max_detections")),
        stages=timing == "stages",
        picture=picture,
        max_side=max_side,
    )


def parse_whole(raw: Optional[str], name: str, lo: int, hi: int, default: int) -> int:
    """Parse a whole number from `lo` to `hi` from a query string; `default` when it is absent."""
    if raw is None:
        return default
    text = raw.strip()
    digits = text.lstrip("0")
    # The length check keeps int() off a 10,000-digit string.
    if not (text.isascii() and text.isdigit() and len(digits) <= len(str(hi)) and lo <= int(digits or "0") <= hi):
        raise InvalidParameter(f"{name} must be a whole number from {lo} to {hi}, not {raw[:40]!r}")
    return int(digits)


def parse_threshold(raw: Optional[str], default: float) -> float:
    """Parse a score threshold from 0 to 1; NaN, infinities and out-of-range values are errors."""
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise InvalidParameter(f"threshold must be a number from 0 to 1, not {raw[:40]!r}")
    return value


def parse_max_detections(raw: Optional[str]) -> int:
    """Parse max_detections, an integer from 1 to 1000."""
    if raw is None:
        return DEFAULT_MAX_DETECTIONS
    text = raw.strip()
    # Leading zeros do not make a number bigger; the length check keeps int() off a 10,000-digit string.
    digits = text.lstrip("0")
    if not (text.isascii() and text.isdigit() and len(digits) <= 4
            and 1 <= int(digits or "0") <= MAX_DETECTIONS_LIMIT):
        raise InvalidParameter(f"max_detections must be an integer from 1 to {MAX_DETECTIONS_LIMIT}, not {raw[:40]!r}")
    return int(digits)


def media_type(content_type: Optional[str]) -> str:
    """Return the bare, lower-case media type of a Content-Type header ('' if absent)."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def images_from_json(body: bytes) -> tuple[list[bytes], bool]:
    """Decode `{"image": b64}` or `{"images": [b64, ...]}`; return the bytes and whether it was a list."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise InvalidBody(f"the body is not valid JSON: {str(exc)[:100]}") from None
    if not isinstance(document, dict):
        raise InvalidBody('the JSON body must be an object: {"image": "<base64>"} or {"images": [...]}')
    if ("image" in document) == ("images" in document):
        raise InvalidBody('the JSON body must have exactly one of "image" (a base64 string) or "images" (a list)')
    if "image" in document:
        encoded = [document["image"]]
        where = ['"image"']
    else:
        if not isinstance(document["images"], list) or not document["images"]:
            raise InvalidBody('"images" must be a non-empty list of base64 strings')
        encoded = document["images"]
        where = [f'"images"[{i}]' for i in range(len(encoded))]
    return [decode_base64(item, name) for item, name in zip(encoded, where)], "images" in document


def check_raw_type(kind: str) -> None:
    """Raise UnsupportedContentType unless `kind` is a content type /detect takes."""
    if kind not in RAW_IMAGE_TYPES and kind not in ("application/json", "multipart/form-data"):
        shown = kind or "none"
        raise UnsupportedContentType(
            f"Content-Type {shown!r} is not accepted; send image/jpeg, image/png, image/webp, image/bmp, "
            "image/gif, multipart/form-data with 'image' fields, or application/json"
        )
