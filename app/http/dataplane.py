"""What every protocol does with a model, whatever its wire format: run images, name the version, read the signature.

KServe's DataPlane in small: /detect, /v2 and /v1 parse their own requests and write their own answers, and
all of them run models through `run_images`, so each request is admitted, decoded, queued and batched the
same way whichever protocol it came in by. Called in WSGI request threads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
from flask import g

from ..errors import DetectError, ImageTooLarge, InferenceFailed, InvalidBody, VersionNotFound
from ..inference.detections import ModelOutputs
from ..inference.images import DecodedImage, decode_image
from ..timeline import Timeline
from .app import service

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """One request's images run through a model, and where its time went."""

    images: list[DecodedImage]
    outputs: list[ModelOutputs]
    version: Optional[str]  # the model version that answered
    decode_s: float
    load_s: float  # waited for the model to load (or restart); 0 when it was ready
    inference_s: float
    total_s: float


def run_images(model, prepare: Callable[[], list[DecodedImage]], deadline: float) -> Run:
    """Admit a request to `model`, get its images from `prepare()`, and run them through the model's queue.

    `prepare` runs after admission, so an unloaded model loads while the images decode; it raises the
    request's own errors (bad input, too large). A model that raises fails this request alone. The stages
    go to the request's timeline, `g.timeline`, which the protocol layer starts (app/timeline.py).
    """
    started = time.perf_counter()
    timeline = g.get("timeline") or Timeline()
    model.admit()  # holds the model loaded, and starts loading it if it is not, while the images decode
    try:
        images = prepare()
        decoded = time.perf_counter()
        timeline.lap("decode")
        load_s = model.wait_ready(deadline)
        if load_s > 0:
            timeline.lap("load")
        try:
            outputs = model.detect_outputs([image.pixels for image in images], deadline, timeline)
        except DetectError:
            raise
        except Exception as exc:
            log.exception("inference failed for a request of %d image(s) to model %s", len(images), model.name)
            raise InferenceFailed(f"the model failed on this request: {type(exc).__name__}") from None
    finally:
        model.release()
    finished = time.perf_counter()
    version = outputs[0].version if outputs and outputs[0].version else served_version(model)
    return Run(images, outputs, version, decode_s=decoded - started, load_s=load_s,
               inference_s=finished - decoded - load_s, total_s=finished - started)


def tensor_images(batch: np.ndarray, signature: dict, settings, where: str) -> list[DecodedImage]:
    """Check a [N, H, W, 3] image tensor against the model's input and the limits; split it into images.

    uint8 pixels are taken as they are. Float pixels (what a float_image_tensor model declares) must be whole
    numbers from 0 to 255: the service carries pixels as uint8 to the model, and that keeps them exact.
    The images are views of `batch`, not copies.
    """
    if batch.ndim != 4 or batch.shape[3] != 3:
        raise InvalidBody(f"{where} must have shape [N, height, width, 3], not {list(batch.shape)}")
    declared = signature["input"]["shape"]
    if len(declared) == 4:
        for axis, name in ((1, "height"), (2, "width")):
            if declared[axis] != -1 and batch.shape[axis] != declared[axis]:
                raise InvalidBody(f"{where} has {name} {batch.shape[axis]}; the model takes {declared[axis]}")
    check_image_count(batch.shape[0], settings, where)
    height, width = batch.shape[1], batch.shape[2]
    if height * width > settings.max_image_pixels:
        raise ImageTooLarge(f"{where} holds {width}x{height} = {width * height} pixel images, over the limit of "
                            f"{settings.max_image_pixels}")
    if batch.dtype != np.uint8:
        if batch.dtype.kind not in "iuf" or not bool(np.all((batch >= 0) & (batch <= 255) & (batch == np.rint(batch)))):
            raise InvalidBody(f"{where}: pixel values must be whole numbers from 0 to 255")
        batch = batch.astype(np.uint8)
    return [DecodedImage(pixels=batch[i], format="tensor", width=width, height=height) for i in range(batch.shape[0])]


def encoded_images(blobs: Sequence[bytes], model, settings, where: str) -> list[DecodedImage]:
    """Decode image files as /detect does: the decoder allowlist, the pixel limit, EXIF orientation."""
    check_image_count(len(blobs), settings, where)
    return decode_files(blobs, model, settings)


def decode_files(blobs: Sequence[bytes], model, settings) -> list[DecodedImage]:
    """Decode image files for `model`: no larger than its working size when decode_at_model_size is on."""
    size = model.working_size() if settings.decode_at_model_size else None
    return [decode_image(blob, settings.max_image_pixels, size) for blob in blobs]


def check_image_count(count: int, settings, where: str) -> None:
    if count > settings.max_images_per_request:
        raise InvalidBody(f"{where} holds {count} images; at most {settings.max_images_per_request} are accepted "
                          "per request (max_images_per_request)")


def served_version(model) -> Optional[str]:
    """Return the version the model serves (or last served), else the one it would load; None if it has none."""
    if model.version is not None:
        return model.version.version
    latest = model.source.latest()
    return latest.version if latest is not None else None


def requested_model(name: str, version: Optional[str]):
    """The model a protocol route names (404 for an unknown name, or for a version it does not serve)."""
    model = service().models.get(name)
    g.model = model.name  # for the request metrics
    check_version(model, version)
    return model


def check_version(model, version: Optional[str]) -> None:
    """Raise VersionNotFound unless `version` is None or the one the model serves: one version is served at a time."""
    if version is None:
        return
    served = served_version(model)
    if version != served:
        raise VersionNotFound(f"model {model.name} has no version {version[:40]!r} being served; it serves version "
                              f"{served}")


def signature_of(model, deadline: float) -> dict:
    """Return the model's signature, from its last load; a model never loaded is loaded (within the deadline) first."""
    if model.signature is None:
        model.admit()
        try:
            model.wait_ready(deadline)
        finally:
            model.release()
    return model.signature
