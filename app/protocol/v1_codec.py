"""TF Serving's REST predict bodies, read and written: the row form (`instances` -> `predictions`) and the
columnar form (`inputs` -> `outputs`). Pure functions over JSON text and numpy arrays, no Flask.

The detector's signature has one input, so a value may be given bare or under the input's name. An image is
either nested lists of pixel values ([height][width][3], numbers from 0 to 255), or `{"b64": "..."}`
holding an encoded image file, as clients of `encoded_image_string_tensor` exports send it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..errors import InvalidBody
from .bodies import decode_base64, json_object

SIGNATURE = "serving_default"


@dataclass(frozen=True)
class Item:
    """One image of a predict request: an encoded file, or pixel values (an array of any numeric type)."""

    encoded: Optional[bytes] = None
    pixels: Optional[np.ndarray] = None


@dataclass(frozen=True)
class PredictRequest:
    row: bool  # the request gave `instances`, so the answer is `predictions`
    items: tuple[Item, ...]


def parse_predict(body: bytes, input_name: str) -> PredictRequest:
    """Read a predict body for a signature whose one input is `input_name`; raise InvalidBody naming the problem."""
    document = json_object(body, "the body", 'a JSON object: {"instances": [...]} or {"inputs": ...}')
    unknown = sorted(set(document) - {"signature_name", "instances", "inputs"})
    if unknown:
        raise InvalidBody(f"unknown field {unknown[0][:40]!r}; a predict request has signature_name and one of "
                          "instances or inputs")
    check_signature_name(document.get("signature_name", SIGNATURE))
    if ("instances" in document) == ("inputs" in document):
        raise InvalidBody("the request must have either 'instances' (the row form) or 'inputs' (the columnar "
                          "form), but not both")
    if "instances" in document:
        instances = document["instances"]
        if not isinstance(instances, list) or not instances:
            raise InvalidBody("'instances' must be a non-empty list")
        return PredictRequest(True, tuple(_instance(x, input_name, f"instance {i}") for i, x in enumerate(instances)))
    return PredictRequest(False, _columns(_named(document["inputs"], input_name, "'inputs'"), "'inputs'"))


def check_signature_name(name) -> None:
    """Refuse a signature other than the one served ('' means it too), over REST or gRPC."""
    if name not in (SIGNATURE, ""):
        raise InvalidBody(f"serving signature name {str(name)[:60]!r} not found; the model has {SIGNATURE!r}")


def _is_b64(value) -> bool:
    return isinstance(value, dict) and set(value) == {"b64"}


def _named(value, input_name: str, where: str):
    """Unwrap {input_name: value}; a bare value is the one input's."""
    if isinstance(value, dict) and not _is_b64(value):
        names = sorted(value)
        if names != [input_name]:
            raise InvalidBody(f"{where} names the inputs {', '.join(repr(n[:40]) for n in names[:5]) or 'none'}; "
                              f"the signature has one input, {input_name!r}")
        return value[input_name]
    return value


def _instance(value, input_name: str, where: str) -> Item:
    value = _named(value, input_name, where)
    if _is_b64(value):
        return Item(encoded=decode_base64(value["b64"], f'{where} "b64"'))
    return Item(pixels=_pixels(value, 3, where))


def _columns(value, where: str) -> tuple[Item, ...]:
    if _is_b64(value):
        raise InvalidBody(f"{where} must be a list of images (a batch), not one")
    if not isinstance(value, list) or not value:
        raise InvalidBody(f"{where} must be a non-empty list: a batch of images")
    if any(_is_b64(item) for item in value):
        if not all(_is_b64(item) for item in value):
            raise InvalidBody(f'{where} mixes {{"b64": ...}} images with pixel values')
        return tuple(Item(encoded=decode_base64(item["b64"], f'{where}[{i}] "b64"')) for i, item in enumerate(value))
    batch = _pixels(value, 4, where)
    return tuple(Item(pixels=batch[i]) for i in range(batch.shape[0]))


def _pixels(value, rank: int, where: str) -> np.ndarray:
    """Nested lists of numbers of the given rank, as an array (values are checked where they are used)."""
    if not isinstance(value, list):
        raise InvalidBody(f'{where} must be pixel values nested as [height][width][3], or {{"b64": "<encoded image>"}}')
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        raise InvalidBody(f"{where} is not a rectangular list of numbers") from None
    if array.dtype.kind not in "iuf" or array.ndim != rank:
        shape = "[batch][height][width][3]" if rank == 4 else "[height][width][3]"
        raise InvalidBody(f"{where} must be numbers nested as {shape}, not shape {list(array.shape)} of "
                          f"{'numbers' if array.dtype.kind in 'iuf' else 'other values'}")
    return array


def write_predictions(arrays: dict[str, np.ndarray], names: Sequence[str], row: bool) -> dict:
    """The answer: `predictions` (one object per instance) for the row form, else `outputs` (one list per output)."""
    if row:
        count = len(next(iter(arrays.values()))) if arrays else 0
        return {"predictions": [{name: arrays[name][i].tolist() for name in names} for i in range(count)]}
    return {"outputs": {name: arrays[name].tolist() for name in names}}
