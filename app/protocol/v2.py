"""KServe v2 / the Open Inference Protocol, as Triton serves it: the logic both front doors share.

HTTP (app/http/v2.py) and gRPC (app/grpc/kserve.py) each read their request into the same `InferRequest`
(app/protocol/v2_codec.py) and call `infer`, which runs the one sequence: the request's options, the
model's signature, its images, the outputs it wants, the run, and the output tensors. Each then writes the
answer in its own wire format. Model metadata (`describe`) is likewise written once.

An inference request gives exactly one input, either
- the model's own input by its signature name (`input_tensor` in Object Detection API exports): UINT8
  [N, H, W, 3] pixels (FP32 too, for a float_image_tensor model), or, for an encoded_image_string_tensor
  model, BYTES [N] image files; or
- `image`, BYTES [N]: one JPEG, PNG, WebP, BMP or GIF file per element (in JSON, each base64-encoded),
  decoded exactly as /detect decodes. A raw request (Inference-Header-Content-Length: 0) is one such file.
Outputs: the signature's detection_boxes [N, K, 4], detection_classes, detection_scores [N, K] and
num_detections [N], all FP32, as the model gives them; and `detections`, BYTES [N], each image's /detect
answer as JSON (labels, pixel boxes), which the request's `threshold` and `max_detections` parameters
shape. The model metadata lists `image` and `detections` under parameters.extra_inputs and extra_outputs.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager, ExitStack, nullcontext, suppress
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import BadRequest, InvalidBody, InvalidParameter
from ..inference.detections import DEFAULT_MAX_DETECTIONS, MAX_DETECTIONS_LIMIT, stack_outputs
from ..inference.images import DecodedImage
from . import shared_tensors
from .bodies import decode_base64
from .plane import DataPlane, Run, image_answer, served_version
from .v2_codec import InferRequest, Tensor

EXTENSIONS = ("binary_tensor_data", "model_configuration", "model_repository", "parameters", "statistics",
              "system_shared_memory")
PLATFORM = "tensorflow_savedmodel"
IMAGE_INPUT = "image"
DETECTIONS_OUTPUT = "detections"
DATATYPES = {"uint8": "UINT8", "float32": "FP32", "string": "BYTES"}  # TensorFlow's names -> the protocol's
# Request parameters Triton defines for its sequence batcher, which this server does not have.
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


def server_metadata(plane: DataPlane) -> dict:
    """The server metadata: name, version, and the protocol extensions it implements."""
    return {"name": plane.name, "version": plane.version, "extensions": list(EXTENSIONS)}


def describe(model, signature: dict) -> dict:
    """The model metadata: the signature's input and outputs, and this server's extra input and output."""
    declared = signature["input"]
    version = served_version(model)
    return {
        "name": model.name,
        "versions": [version] if version is not None else [],
        "platform": PLATFORM,
        "inputs": [{"name": declared["name"], "datatype": DATATYPES.get(declared["dtype"], declared["dtype"].upper()),
                    "shape": declared["shape"]}],
        # The service sends every output as FP32, whatever the graph's own float type.
        "outputs": [{"name": out["name"], "datatype": "FP32", "shape": out["shape"]} for out in signature["outputs"]],
        "parameters": {
            "input_type": declared.get("kind", "image_tensor"),
            "extra_inputs": [{"name": IMAGE_INPUT, "datatype": "BYTES", "shape": [-1],
                              "description": "encoded image files (JPEG, PNG, WebP, BMP, GIF; base64 in JSON), "
                                             "decoded by the server as POST /detect decodes them; send it instead "
                                             f"of {declared['name']}"}],
            "extra_outputs": [{"name": DETECTIONS_OUTPUT, "datatype": "BYTES", "shape": [-1],
                               "description": "each image's /detect answer as JSON: width, height, and detections "
                                              "with labels and boxes in pixels; shaped by the request parameters "
                                              "threshold and max_detections"}],
        },
    }


# The protocol's datatypes as Triton's model configuration names them.
CONFIG_TYPES = {"UINT8": "TYPE_UINT8", "FP32": "TYPE_FP32", "BYTES": "TYPE_STRING"}


# The precision in force, as Triton's model configuration names an execution accelerator: (list, name).
ACCELERATORS = {"fp16": ("gpu_execution_accelerator", "auto_mixed_precision"),
                "bf16": ("cpu_execution_accelerator", "auto_mixed_precision_onednn_bfloat16")}


def model_config(plane: DataPlane, model, described: dict) -> dict:
    """The model's configuration in Triton's JSON form (what its HTTP config route and, as a ModelConfig
    message, its gRPC ModelConfig answer): the tensors from the signature, and the batching, queue and
    concurrency the server applies to it, from the model's settings."""
    settings = plane.settings.for_model(model.name)
    batched = described["inputs"][0]["shape"][:1] == [-1]

    def tensors(entries: list[dict], extra: dict) -> list[dict]:
        return [{"name": t["name"], "data_type": CONFIG_TYPES.get(t["datatype"], "TYPE_INVALID"),
                 "dims": t["shape"][1:] if batched else t["shape"], **extra} for t in entries]

    config = {
        "name": model.name, "platform": PLATFORM, "backend": "tensorflow",
        "version_policy": {"latest": {"num_versions": 1}},  # the highest version on disk, one at a time
        "max_batch_size": settings.max_batch_size if batched else 0,
        "input": tensors(described["inputs"], {"format": "FORMAT_NHWC" if batched else "FORMAT_NONE",
                                               "is_shape_tensor": False, "allow_ragged_batch": False,
                                               "optional": False}),
        "output": tensors(described["outputs"], {"label_filename": "", "is_shape_tensor": False}),
        # One model call runs at a time per inference thread, in the model's one worker process.
        "instance_group": [{"name": model.name, "kind": "KIND_MODEL", "count": settings.inference_threads,
                            "gpus": list(settings.gpus or ())}],
    }
    if settings.worker_group:  # its worker is its group's: the instance group is named so, and a parameter says it
        config["instance_group"][0]["name"] = settings.worker_group
        config["parameters"] = {"worker_group": {"string_value": settings.worker_group}}
    accelerator = ACCELERATORS.get((model.execution or {}).get("precision"))  # none while unloaded
    if accelerator is not None:  # Triton's TensorFlow backend names fp16 so; bf16 is ours, in the CPU's list
        config["optimization"] = {"execution_accelerators": {accelerator[0]: [{"name": accelerator[1]}]}}
    if batched:
        config["dynamic_batching"] = {
            # No preferred sizes: a batch takes all the queue holds, up to max_batch_size, as Triton does without them.
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": round(settings.max_batch_delay_ms * 1000),
            "preserve_ordering": False,
            "default_queue_policy": {"timeout_action": "REJECT", "max_queue_size": settings.max_queue,
                                     "default_timeout_microseconds": round(plane.settings.request_deadline_s * 1e6),
                                     "allow_timeout_override": True},
        }
    return config


def statistics(plane: DataPlane, name: Optional[str] = None, version: Optional[str] = None) -> dict:
    """Triton's statistics extension: every model's statistics, or the one `name` (and `version`, if given)
    names; NotFound for an unknown model, VersionNotFound for a version it does not serve (app/statistics.py)."""
    models = [plane.model(name, version)] if name else [plane.models.get(n) for n in plane.models.names()]
    return {"model_stats": [plane.metrics.statistics.model_stats(model.name, served_version(model) or "")
                            for model in models]}


def model_metadata(plane: DataPlane, model, deadline: float) -> dict:
    """The metadata of `model`; a model never loaded is loaded first (within the deadline)."""
    return describe(model, plane.signature_of(model, deadline))


def model_ready(model, version: Optional[str] = None) -> bool:
    """Whether `model` answers now: loaded and ready, and `version` (if given) the one it serves."""
    return version in (None, "", served_version(model)) and model.state == "ready"


# Inference --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InferOptions:
    threshold: float
    max_detections: int
    timeout_s: float


@dataclass(frozen=True)
class Inferred:
    """An inference's answer, before a front door writes it: the model, its version, the request's id, and each
    output tensor with whether it goes as binary data."""

    model_name: str
    version: Optional[str]
    request_id: Optional[str]
    tensors: list[tuple[Tensor, bool]]


def infer(plane: DataPlane, model, parsed: InferRequest, deadline_within: Callable[[float], float],
          admit: Callable[[object], AbstractContextManager] = lambda model: nullcontext()) -> Inferred:
    """Run one v2 inference request on `model`: options, signature, images, wanted outputs, run, output tensors.

    `deadline_within(timeout_s)` turns the request's timeout into its deadline (gRPC also heeds the client's);
    `admit(model)` is the front door's admission around the model's work (app/protocol/admission.py: gRPC
    admits each call here; the HTTP site admitted the request before the app ran). Tensors in shared memory are
    checked before anything is read, and read only once admitted (app/protocol/shared_tensors.py).
    """
    options = request_options(parsed.parameters, plane.settings)
    deadline = deadline_within(options.timeout_s)
    with ExitStack() as regions:  # the shared-memory regions the request names stay held until it is answered
        placed = shared_tensors.hold(plane, parsed, regions)
        with admit(model):
            signature = plane.signature_of(model, deadline)
            images = shared_tensors.image_count(parsed)
            if images is not None:
                shared_tensors.check_output_rooms(placed, signature, images)
            parsed = shared_tensors.read_inputs(parsed, placed)
            prepare = request_images(plane, parsed, model, signature)
            wanted = wanted_outputs(parsed, signature)
            run = plane.run_images(model, prepare, deadline)
        tensors = output_tensors(run, wanted, model.labels, options)
        tensors = shared_tensors.write_outputs(tensors, placed)
    return Inferred(model.name, run.version, parsed.id, tensors)


def check_named_model(parsed: InferRequest, name: str, version: Optional[str]) -> Optional[str]:
    """Check the model the body names against the one the path names (KServe's SDK repeats it in the body);
    return the version to serve: the path's, else the body's."""
    if parsed.model_name is not None and parsed.model_name != name:
        raise InvalidBody(f"the body names model {parsed.model_name[:100]!r} but the path names {name[:100]!r}")
    if parsed.model_version is not None and version is not None and parsed.model_version != version:
        raise InvalidBody(f"the body names version {parsed.model_version[:40]!r} but the path names {version[:40]!r}")
    return version if version is not None else parsed.model_version


def request_options(parameters: dict, settings) -> InferOptions:
    """Read the request's parameters as Triton treats them: those this server uses are checked (threshold,
    max_detections, Triton's timeout in microseconds, priority), each within its range, and a wrong value is
    refused naming it; any other is accepted and ignored, as Triton passes it on to a backend that may not read
    it (its clients add `triton_`-prefixed ones). A number may come as a string holding one (KServe's gRPC SDK
    can send no float)."""
    for key in SEQUENCE_PARAMETERS:
        if parameters.get(key) not in (None, 0, "", False):
            raise BadRequest("sequence batching is not implemented: every request stands alone; drop sequence_id")
    threshold = _number(parameters, "threshold", settings.default_threshold)
    limit = _number(parameters, "max_detections", DEFAULT_MAX_DETECTIONS)
    timeout = _number(parameters, "timeout", 0)
    _number(parameters, "priority", 0)
    # Triton's timeout is a uint64 of microseconds, 0 for none; any more than the server's own deadline is that.
    timeout_s = settings.request_deadline_s if timeout == 0 else min(settings.request_deadline_s, timeout / 1e6)
    return InferOptions(float(threshold), limit, timeout_s)


UINT64_MAX = 2**64 - 1
# Each parameter this server reads: its type, its range, and how a refusal says so.
_RANGES = {
    "threshold": (float, 0.0, 1.0, "a number from 0 to 1"),
    "max_detections": (int, 1, MAX_DETECTIONS_LIMIT, f"an integer from 1 to {MAX_DETECTIONS_LIMIT}"),
    "timeout": (int, 0, UINT64_MAX, f"a whole number of microseconds, from 0 to {UINT64_MAX}"),
    "priority": (int, 0, UINT64_MAX, f"an integer from 0 to {UINT64_MAX}"),
}


def _number(parameters: dict, key: str, default):
    """The parameter `key`, from a number or a string holding one, checked against its type and range
    (_RANGES); `default` if absent. Anything else is InvalidParameter naming it, never an overflow later."""
    kind, low, high, allowed = _RANGES[key]
    value = parameters.get(key, default)
    if isinstance(value, str) and len(value) <= 40:  # a longer string holds no number this server takes
        with suppress(ValueError):  # a string that holds no number is refused below, as it was sent
            value = int(value.strip()) if kind is int else float(value.strip())
    valid = type(value) is int if kind is int else type(value) in (int, float)
    if not valid or not low <= value <= high:  # NaN compares false, infinity is out of range
        raise InvalidParameter(f"the parameter {key} must be {allowed}, not {value!r:.40}")
    return value


def request_images(plane: DataPlane, parsed: InferRequest, model,
                   signature: dict) -> Callable[[], list[DecodedImage]]:
    """Check the request's one input against the model; return what decodes it (run after admission)."""
    declared = signature["input"]
    encoded_model = declared["dtype"] == "string"
    if parsed.raw is not None:
        return lambda: plane.encoded_images([parsed.raw], model, "the raw request body")
    if len(parsed.inputs) != 1:
        raise InvalidBody(f"the request has {len(parsed.inputs)} inputs; give one: {declared['name']!r} or "
                          f"{IMAGE_INPUT!r}")
    tensor = parsed.inputs[0]
    where = f"input {tensor.name!r}"
    if tensor.name == IMAGE_INPUT or (encoded_model and tensor.name == declared["name"]):
        if tensor.datatype != "BYTES" or len(tensor.shape) != 1:
            raise InvalidBody(f"{where} must be BYTES of shape [N], one encoded image file per element, not "
                              f"{tensor.datatype} {list(tensor.shape)}")
        blobs = tensor.data if tensor.binary else [
            decode_base64(item.decode("utf-8", "replace"), f"{where} element {i}") for i, item in enumerate(tensor.data)]
        return lambda: plane.encoded_images(blobs, model, where)
    if tensor.name != declared["name"]:
        raise InvalidBody(f"unknown input {tensor.name!r}; model inputs are {declared['name']!r} and {IMAGE_INPUT!r}")
    allowed = ("UINT8", "FP32") if declared["dtype"] == "float32" else ("UINT8",)
    if tensor.datatype not in allowed:
        raise InvalidBody(f"{where} has datatype {tensor.datatype}; the model takes {' or '.join(allowed)}")
    images = plane.tensor_images(tensor.data, signature, where)
    return lambda: images


def wanted_outputs(parsed: InferRequest, signature: dict) -> list[tuple[str, bool]]:
    """The outputs to answer with, and whether each goes as binary data; every signature output by default."""
    names = [out["name"] for out in signature["outputs"]]
    if parsed.outputs is None:
        return [(name, parsed.binary_output) for name in names]
    known = [*names, DETECTIONS_OUTPUT]
    wanted = []
    for output in parsed.outputs:
        if output.name not in known:
            raise InvalidBody(f"unknown output {output.name!r}; the outputs are {', '.join(known)}")
        wanted.append((output.name, parsed.binary_output if output.binary is None else output.binary))
    return wanted


def output_tensors(run: Run, wanted: list[tuple[str, bool]], labels: dict,
                   options: InferOptions) -> list[tuple[Tensor, bool]]:
    """The wanted outputs of `run` as tensors: the model's arrays stacked, `detections` as JSON per image."""
    arrays = stack_outputs(run.outputs)
    tensors = []
    for name, binary in wanted:
        if name == DETECTIONS_OUTPUT:
            answers = [json.dumps(image_answer(image, out, labels, options.threshold, options.max_detections),
                                  separators=(",", ":")).encode()
                       for image, out in zip(run.images, run.outputs)]
            tensors.append((Tensor(name, "BYTES", (len(answers),), answers), binary))
        else:
            tensors.append((Tensor(name, "FP32", arrays[name].shape, arrays[name]), binary))
    return tensors
