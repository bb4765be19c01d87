"""Run a TF2 SavedModel that honours the Object Detection API serving contract.

Contract: signature `serving_default` with one image input, as `exporter_main_v2.py --input_type` makes it:
`image_tensor` (uint8 [B, H, W, 3]), `float_image_tensor` (float32 [B, H, W, 3], pixel values 0 to 255) or
`encoded_image_string_tensor` (string [B], one encoded image each), where B is 1 (model-zoo exports) or
None (any batch); outputs `detection_boxes` (normalized [ymin, xmin, ymax, xmax]), `detection_classes`
(1-based, float), `detection_scores` and `num_detections`. Other outputs are ignored.

Every kind is fed the same thing: the upright RGB uint8 pixels that the HTTP process decoded (EXIF
orientation applied), so that boxes are in the displayed image whatever the kind. A float model gets them
cast to float32; an encoded-image model gets each image re-encoded losslessly as PNG, which its graph decodes
back to exactly those pixels.

It runs inside a model's worker process (app.models.worker); the HTTP process never imports it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import DetectError, InferenceFailed, ModelError, OutOfMemory
from .detections import OUTPUT_NAMES, Detection, ModelOutputs, to_detections
from .labels import load_label_map
from ..models.repository import ModelVersion, resolve_model

log = logging.getLogger(__name__)

# The input kinds, named as exporter_main_v2.py's --input_type names them, by the input's dtype and rank.
INPUT_KINDS = {("uint8", 4): "image_tensor", ("float32", 4): "float_image_tensor",
               ("string", 1): "encoded_image_string_tensor"}

# Called after each model call with (images in the call, seconds it took).
CallObserver = Callable[[int, float], None]


class Detector:
    """A loaded detector; `detect` may be called from many threads at once."""

    def __init__(self, model: ModelVersion, loaded, signature, labels: dict[int, str],
                 on_model_call: Optional[CallObserver] = None, on_out_of_memory: Optional[Callable[[], None]] = None,
                 memory_limit: str = "this instance's memory policy"):
        self.model = model
        self._on_out_of_memory = on_out_of_memory
        self.memory_limit = memory_limit  # named in out-of-memory errors, e.g. "the GPU cap of 4096 MiB"
        self._loaded = loaded  # keeps the variables alive for as long as the signature is used
        self._signature = signature
        self.labels = labels
        self._on_model_call = on_model_call
        self.input_name, self.input_dtype, self.input_shape = _input_spec(signature, model)
        self.input_kind = INPUT_KINDS[(self.input_dtype, len(self.input_shape))]
        # [B, H, W, 3] of the pixels fed in, whatever the kind (an encoded image has any size).
        self.image_shape = self.input_shape if len(self.input_shape) == 4 else (self.input_shape[0], None, None, 3)
        _check_outputs(signature, model)
        # The batch dimension caps how many images one call may carry: 1 for zoo exports.
        batch = self.input_shape[0]
        self.max_batch: Optional[int] = None if batch is None else int(batch)
        import tensorflow as tf

        self._tf = tf

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def version(self) -> str:
        return self.model.version

    def run(self, batch: np.ndarray) -> list[ModelOutputs]:
        """Run one model call on a [B, H, W, 3] uint8 batch; B must fit the batch dimension."""
        if self.max_batch is not None and batch.shape[0] > self.max_batch:
            raise ValueError(f"batch of {batch.shape[0]} exceeds the model's batch dimension {self.max_batch}")
        started = time.perf_counter()
        outputs = self._signature(**{self.input_name: self._feed(batch)})
        boxes = outputs["detection_boxes"].numpy()
        classes = outputs["detection_classes"].numpy()
        scores = outputs["detection_scores"].numpy()
        counts = outputs["num_detections"].numpy().reshape(-1)
        if self._on_model_call is not None:
            self._on_model_call(batch.shape[0], time.perf_counter() - started)
        boxes, classes, scores = (a.astype(np.float32, copy=False) for a in (boxes, classes, scores))
        return [
            ModelOutputs(boxes=boxes[i], classes=classes[i], scores=scores[i],
                         count=int(min(max(counts[i], 0), scores.shape[1])))
            for i in range(batch.shape[0])
        ]

    def _feed(self, batch: np.ndarray):
        """Turn a uint8 [B, H, W, 3] batch of upright pixels into the tensor this model's input takes."""
        tf = self._tf
        if self.input_kind == "float_image_tensor":
            return tf.cast(tf.convert_to_tensor(batch), tf.float32)
        if self.input_kind == "encoded_image_string_tensor":
            # PNG is lossless: the model's own decoder gets back exactly the pixels decoded here, EXIF
            # orientation applied, which the original file (with its orientation tag) would not give it.
            return tf.stack([tf.io.encode_png(image, compression=1) for image in batch])
        return tf.convert_to_tensor(batch)

    def signature(self) -> dict:
        """Describe the serving signature: the image input and the contract's outputs, -1 for any size."""
        outputs = self._signature.structured_outputs
        return {
            "input": {"name": self.input_name, "dtype": self.input_dtype, "kind": self.input_kind,
                      "shape": [-1 if d is None else int(d) for d in self.input_shape]},
            "outputs": [
                {"name": name, "dtype": outputs[name].dtype.name,
                 "shape": [-1 if d is None else int(d) for d in outputs[name].shape.as_list()]}
                for name in OUTPUT_NAMES
            ],
        }

    def signature_defs(self) -> dict:
        """Return the SavedModel's signature_def map as TF Serving's metadata shows it (proto field names)."""
        from google.protobuf import json_format
        from tensorflow.core.protobuf import saved_model_pb2

        proto = saved_model_pb2.SavedModel()
        try:
            proto.ParseFromString((self.model.path / "saved_model.pb").read_bytes())
        except Exception as exc:  # the model loaded; a report of its signatures must not fail it
            log.warning("cannot read the signature_def map of %s: %s", self.model.path, _first_line(exc))
            return {}
        if not proto.meta_graphs:
            return {}
        return {name: json_format.MessageToDict(signature, preserving_proto_field_name=True,
                                                always_print_fields_with_no_presence=True)
                for name, signature in sorted(proto.meta_graphs[0].signature_def.items())}

    def run_batch(self, batch: np.ndarray) -> list["ModelOutputs | DetectError"]:
        """Run a batch; where it fails, split it in halves down to single images.

        So one bad image fails alone, and a batch that does not fit under the memory cap is retried
        in smaller calls. Return one result or error per image, in order.
        """
        try:
            return self.run(batch)
        except self._tf.errors.ResourceExhaustedError as exc:
            if self._on_out_of_memory is not None:
                self._on_out_of_memory()
            if batch.shape[0] == 1:
                log.warning("out of memory on one %dx%d image under %s: %s", batch.shape[2], batch.shape[1],
                            self.memory_limit, _first_line(exc))
                return [OutOfMemory(
                    f"the model ran out of memory on this image alone under {self.memory_limit}; "
                    "send a smaller image or raise the cap"
                )]
            log.warning("out of memory on a batch of %d under %s; retrying in halves", batch.shape[0],
                        self.memory_limit)
        except Exception as exc:  # the model's own failure on some input; isolate it
            if batch.shape[0] == 1:
                log.error("the model failed on one %dx%d image: %s: %s", batch.shape[2], batch.shape[1],
                          type(exc).__name__, _first_line(exc))
                return [InferenceFailed(f"the model failed on this image: {type(exc).__name__}")]
        half = batch.shape[0] // 2
        return self.run_batch(batch[:half]) + self.run_batch(batch[half:])

    def infer(self, images: Sequence[np.ndarray]) -> list[ModelOutputs]:
        """Run images through the model, in as few calls as the batch dimension and sizes allow."""
        results: list[Optional[ModelOutputs]] = [None] * len(images)
        limit = self.max_batch or len(images) or 1
        groups: dict[tuple, list[int]] = {}
        for i, image in enumerate(images):
            groups.setdefault(image.shape, []).append(i)
        for positions in groups.values():
            for start in range(0, len(positions), limit):
                chunk = positions[start:start + limit]
                batch = np.stack([images[i] for i in chunk]) if len(chunk) > 1 else images[chunk[0]][None]
                for i, out in zip(chunk, self.run_batch(batch)):
                    if isinstance(out, DetectError):
                        raise out
                    results[i] = out
        return results  # type: ignore[return-value]

    def detect(self, images: Sequence[np.ndarray], threshold: float, max_detections: int,
               deadline: Optional[float] = None, sizes: Optional[Sequence[tuple[int, int]]] = None
               ) -> list[list[Detection]]:
        """Detect objects in RGB uint8 images [H, W, 3]; one list per image, best score first.

        Boxes are in pixels of `sizes` (width, height per image: the originals' where the images were
        decoded reduced), else of the images themselves. In-process use runs the calls in the caller's
        thread; `deadline` is ignored here.
        """
        if sizes is None:
            sizes = [(image.shape[1], image.shape[0]) for image in images]
        if len(sizes) != len(images):
            raise ValueError(f"{len(images)} images but {len(sizes)} sizes")
        return [
            to_detections(out, width, height, self.labels, threshold, max_detections)
            for (width, height), out in zip(sizes, self.infer(images))
        ]

    def warm_up(self) -> None:
        """Run one inference so the first request does not pay for tracing and allocation."""
        height = self.image_shape[1] or 320
        width = self.image_shape[2] or 320
        self.run(np.zeros((1, height, width, 3), dtype=np.uint8))


def _input_spec(signature, model: ModelVersion):
    _, kwargs = signature.structured_input_signature
    if len(kwargs) != 1:
        raise ModelError(
            f"model {model.path}: serving_default must take one image input, it takes {sorted(kwargs) or 'none'}"
        )
    (name, spec), = kwargs.items()
    shape = spec.shape
    kind = INPUT_KINDS.get((spec.dtype.name, shape.rank))
    if kind is None or (shape.rank == 4 and shape[3] not in (3, None)):
        raise ModelError(
            f"model {model.path}: input {name!r} is {spec.dtype.name} {shape}; the contract is a uint8 "
            "(image_tensor) or float32 (float_image_tensor) image of shape [batch, height, width, 3], or a "
            "string tensor of encoded images of shape [batch] (encoded_image_string_tensor)"
        )
    return name, spec.dtype.name, tuple(shape.as_list())


def _check_outputs(signature, model: ModelVersion) -> None:
    outputs = signature.structured_outputs
    missing = [key for key in OUTPUT_NAMES if key not in outputs]
    if missing:
        raise ModelError(f"model {model.path}: serving_default lacks the outputs {', '.join(missing)}")


def load_detector(path, on_model_call: Optional[CallObserver] = None, **options) -> Detector:
    """Load the model at a base path or version folder; raise ModelError naming what is wrong.

    `options` go to Detector (on_out_of_memory, memory_limit).
    """
    model = resolve_model(path)
    import tensorflow as tf

    try:
        loaded = tf.saved_model.load(str(model.path))
    except Exception as exc:  # TF raises many types (OSError, DecodeError, NotFoundError...) for bad files
        raise ModelError(f"model {model.path} cannot be loaded as a SavedModel: {_first_line(exc)}") from None
    signatures = getattr(loaded, "signatures", {})
    if "serving_default" not in signatures:
        raise ModelError(f"model {model.path} has no serving_default signature (it has {sorted(signatures)})")
    labels = load_label_map(model.path / "label_map.pbtxt")
    detector = Detector(model, loaded, signatures["serving_default"], labels, on_model_call, **options)
    log.info(
        "loaded model %s version %s from %s: input %s %s, %d labels",
        model.name, model.version, model.path, detector.input_name, list(detector.input_shape), len(labels),
    )
    return detector


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
