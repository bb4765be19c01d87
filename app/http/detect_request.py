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

RAW_IMAGE_TYPES = ("image/jpeg", "image/jpg", "image/png", "image/webp", "image/bmp", "image/x-ms-bmp", "image/gif")


@dataclass(frozen=True)
class DetectParams:
    """The query parameters of one /detect request."""

    threshold: float
    max_detections: int
    stages: bool = False  # timing=stages: timing_ms also says where the time went, stage by stage


def parse_params(args, default_threshold: float) -> DetectParams:
    """Parse `threshold` (0..1), `max_detections` (1..1000) and `timing` (stages) from a mapping of query strings."""
    unknown = sorted(set(args) - {"threshold", "max_detections", "timing"})
    if unknown:
        raise InvalidParameter(f"unknown query parameter {unknown[0]!r}; /detect takes threshold, max_detections "
                               "and timing")
    timing = args.get("timing")
    if timing not in (None, "stages"):
        raise InvalidParameter(f"timing must be 'stages' (timing_ms then breaks the time down by stage), not "
                               f"{timing[:40]!r}")
    return DetectParams(
        threshold=parse_threshold(args.get("threshold"), default_threshold),
        max_detections=parse_max_detections(args.get("max_detections")),
        stages=timing == "stages",
    )


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
