"""The data plane: what every front door does with a model, whatever its wire format.

KServe's and MLServer's DataPlane in small. HTTP (app/http) and gRPC (app/grpc) each parse their own
requests and write their own answers; both are handed one `DataPlane`, which names the server, holds the
one readiness rule, finds the model a request names and runs images through it, so each request is
admitted, decoded, queued and batched the same way whichever protocol it came in by. The request's own
state (its model, its Timeline) is in app/protocol/context.py. Called in request threads (WSGI's and
gRPC's); thread-safe, as the registry it calls is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import numpy as np

from .. import __version__
from ..access import SHARED_MEMORY, Restriction, group_refusal, parse_restricted_api
from ..errors import ClientGone, DetectError, ImageTooLarge, InferenceFailed, InvalidBody, NotReady, VersionNotFound
from ..inference.detections import Detection, ModelOutputs, to_detections
from ..inference.images import DecodedImage, decode_image
from ..metrics import ServiceMetrics
from ..settings import Settings
from ..timeline import Timeline
from . import context
from .shared_memory import SharedMemoryRegions

if TYPE_CHECKING:
    from ..gpu.report import GpuReport
    from ..models.registry import ModelRegistry

log = logging.getLogger(__name__)

SERVER_NAME = "gpu-share-detect"  # the package's name, as server metadata and the OpenAPI document give it


def server_version() -> str:
    """The service's version: app.__version__, which pyproject.toml also reads."""
    return __version__


class Lifecycle(Protocol):
    """Where the server is in its life (app.hosting.lifecycle.Lifecycle): whether it drains, and whether its
    reactor still turns."""

    @property
    def draining(self) -> bool: ...

    @property
    def responsive(self) -> bool: ...


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


@dataclass
class DataPlane:
    """What both front doors share: the settings, the model registry, the GPU report, metrics, the lifecycle.

    Built once at boot (app/hosting/serve.py; tests build their own) and handed to the Flask app and the
    gRPC servicers. `restrictions` is the restricted-API policy, parsed once from the settings.
    """

    settings: Settings
    models: "ModelRegistry"
    gpu: "GpuReport"
    metrics: ServiceMetrics
    lifecycle: Optional[Lifecycle] = None
    restrictions: tuple[Restriction, ...] = field(init=False)
    shared_memory: SharedMemoryRegions = field(init=False)  # the system shared-memory regions clients registered

    def __post_init__(self):
        self.restrictions = parse_restricted_api(self.settings.restricted_api)
        self.shared_memory = SharedMemoryRegions(same_owner=self.settings.shared_memory_same_owner)

    name = SERVER_NAME

    @property
    def version(self) -> str:
        return server_version()

    # Readiness: the one rule every health answer reads ------------------------------------------------

    @property
    def draining(self) -> bool:
        """Whether shutdown has begun."""
        return self.lifecycle is not None and self.lifecycle.draining

    def not_ready(self) -> Optional[NotReady]:
        """Why the server is not ready (a NotReady to raise), or None once every preloaded model has loaded
        (and none failed), until shutdown begins."""
        if self.draining:
            return NotReady("the server is shutting down")
        if not self.models.ready:
            failure = self.models.boot_failure()
            return NotReady("the models are loading" if failure is None else f"a preloaded model failed: {failure}")
        return None

    def alive(self) -> bool:
        """Whether the server answers at all: its reactor, which every HTTP request passes, still turns."""
        return self.lifecycle is None or self.lifecycle.responsive

    def ready(self) -> bool:
        """Whether the server is ready: every preloaded model loaded, none failed, shutdown not begun."""
        return self.not_ready() is None

    # Finding models ----------------------------------------------------------------------------------

    def model(self, name: str, version: Optional[str] = None):
        """The model a request names (NotFound for an unknown name; VersionNotFound for a version it does not
        serve); the request's context records its name."""
        model = self.models.get(name)
        context.name_model(model.name)
        check_version(model, version)
        return model

    def default_model(self):
        """The model POST /detect serves; the request's context records its name."""
        model = self.models.default()
        context.name_model(model.name)
        return model

    def find_model(self, name: str):
        """The model named `name`, or None: for answers that report an unknown name themselves (gRPC health)."""
        return self.models.models.get(name)

    # Running images ----------------------------------------------------------------------------------

    def run_images(self, model, prepare: Callable[[], list[DecodedImage]], deadline: float) -> Run:
        """Admit a request to `model`, get its images from `prepare()`, and run them through the model's queue.

        `prepare` runs after admission, so an unloaded model loads while the images decode; it raises the
        request's own errors (bad input, too large). A model that raises fails this request alone. The
        stages go to the request's timeline (app/protocol/context.py), which the front door started.
        """
        started = time.perf_counter()
        request = context.current()
        timeline = request.timeline if request is not None else Timeline()
        cancellation = request.cancellation if request is not None else None
        model.admit()  # holds the model loaded, and starts loading it if it is not, while the images decode
        if request is not None:
            request.ran = True
        try:
            images = prepare()
            if request is not None:
                request.images = len(images)
            decoded = time.perf_counter()
            timeline.lap("decode")
            load_s = model.wait_ready(deadline)
            if load_s > 0:
                timeline.lap("load")
            if cancellation is not None and cancellation.cancelled:
                raise ClientGone("the client went away before its images reached the model")
            try:
                outputs = model.detect_outputs([image.pixels for image in images], deadline, timeline, cancellation)
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

    def observe_statistics(self, answered: bool) -> None:
        """Count the current request in its model's statistics (app/statistics.py), if it reached the model;
        the front door calls this once the answer is built, `answered` or failed."""
        request = context.current()
        if request is not None and request.ran:
            self.metrics.statistics.observe_request(request.model, request.images, request.timeline.seconds, answered)

    def signature_of(self, model, deadline: float) -> dict:
        """Return the model's signature, from its last load; a model never loaded is loaded (within the
        deadline) first."""
        if model.signature is None:
            model.admit()
            try:
                model.wait_ready(deadline)
            finally:
                model.release()
        return model.signature

    def shared_memory_region(self, name: str, where: str):
        """Hold the registered region `name` for the current request (a context manager, app/protocol/shared_memory.py),
        if its client may use shared memory: the same rule as registering one (the shared-memory group, loopback
        only unless restricted_api grants it to a header); Forbidden otherwise, before the region is looked up,
        so a client that may not use shared memory learns nothing of which names are registered."""
        request = context.current()
        client = request.client if request is not None else context.Client()
        refused = group_refusal(SHARED_MEMORY, client.headers, client.address, self.restrictions)
        if refused is not None:
            raise refused
        return self.shared_memory.use(name, where)

    def deadline(self, limit_s: Optional[float] = None) -> float:
        """A request's deadline (time.monotonic()): `limit_s`, or request_deadline_s, from now."""
        return time.monotonic() + (self.settings.request_deadline_s if limit_s is None else limit_s)

    # Inputs, checked as every protocol checks them ------------------------------------------------------

    def tensor_images(self, batch: np.ndarray, signature: dict, where: str) -> list[DecodedImage]:
        """Check a [N, H, W, 3] image tensor against the model's input and the limits; split it into images.

        uint8 pixels are taken as they are. Float pixels (what a float_image_tensor model declares) must be
        whole numbers from 0 to 255: the service carries pixels as uint8 to the model, and that keeps them
        exact. The images are views of `batch`, not copies.
        """
        settings = self.settings
        if batch.ndim != 4 or batch.shape[3] != 3:
            raise InvalidBody(f"{where} must have shape [N, height, width, 3], not {list(batch.shape)}")
        declared = signature["input"]["shape"]
        if len(declared) == 4:
            for axis, name in ((1, "height"), (2, "width")):
                if declared[axis] != -1 and batch.shape[axis] != declared[axis]:
                    raise InvalidBody(f"{where} has {name} {batch.shape[axis]}; the model takes {declared[axis]}")
        self.check_image_count(batch.shape[0], where)
        height, width = batch.shape[1], batch.shape[2]
        if height * width > settings.max_image_pixels:
            raise ImageTooLarge(f"{where} holds {width}x{height} = {width * height} pixel images, over the limit "
                                f"of {settings.max_image_pixels}")
        if batch.dtype != np.uint8:
            if batch.dtype.kind not in "iuf" or not bool(
                    np.all((batch >= 0) & (batch <= 255) & (batch == np.rint(batch)))):
                raise InvalidBody(f"{where}: pixel values must be whole numbers from 0 to 255")
            batch = batch.astype(np.uint8)
        return [DecodedImage(pixels=batch[i], format="tensor", width=width, height=height)
                for i in range(batch.shape[0])]

    def encoded_images(self, blobs: Sequence[bytes], model, where: str) -> list[DecodedImage]:
        """Decode image files as /detect does: the decoder allowlist, the pixel limit, EXIF orientation."""
        self.check_image_count(len(blobs), where)
        return self.decode_files(blobs, model)

    def decode_files(self, blobs: Sequence[bytes], model, picture_side: Optional[int] = None) -> list[DecodedImage]:
        """Decode image files for `model`: no larger than its working size when decode_at_model_size is on; with
        `picture_side`, each keeps its upright picture too, its longest side at most that (0: full size)."""
        size = model.working_size() if self.settings.decode_at_model_size else None
        return [decode_image(blob, self.settings.max_image_pixels, size, picture_side) for blob in blobs]

    def check_image_count(self, count: int, where: str) -> None:
        """Refuse a request of more images than max_images_per_request."""
        limit = self.settings.max_images_per_request
        if count > limit:
            raise InvalidBody(f"{where} holds {count} images; at most {limit} are accepted per request "
                              "(max_images_per_request)")


def image_answer(image: DecodedImage, outputs: ModelOutputs, labels: dict, threshold: float,
                 max_detections: int) -> dict:
    """One image's detections as /detect answers them (and v2's `detections` output): size, labelled pixel boxes."""
    return detections_answer(image, to_detections(outputs, image.width, image.height, labels, threshold,
                                                  max_detections))


def detections_answer(image: DecodedImage, detections: Sequence[Detection]) -> dict:
    """An image's size and its detections, as /detect answers them."""
    return {"width": image.width, "height": image.height, "detections": [d.to_json() for d in detections]}


def served_version(model) -> Optional[str]:
    """Return the version the model serves (or last served), else the one it would load; None if it has none."""
    if model.version is not None:
        return model.version.version
    latest = model.source.latest()
    return latest.version if latest is not None else None


def check_version(model, version: Optional[str]) -> None:
    """Raise VersionNotFound unless `version` is None or the one the model serves: one version is served at a time."""
    if version is None:
        return
    served = served_version(model)
    if version != served:
        raise VersionNotFound(f"model {model.name} has no version {version[:40]!r} being served; it serves version "
                              f"{served}")
