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
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import BadRequest, InvalidBody, InvalidParameter
from ..inference.detections import DEFAULT_MAX_DETECTIONS, MAX_DETECTIONS_LIMIT, stack_outputs
from ..inference.images import DecodedImage
from .bodies import decode_base64
from .plane import DataPlane, Run, image_answer, served_version
from .v2_codec import InferRequest, Tensor

EXTENSIONS = ("binary_tensor_data", "model_repository", "parameters")
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
    `admit(model)` is the front door's own admission around the model's work (gRPC bounds its calls; the
    HTTP site admits before the app runs).
    """
    options = request_options(parsed.parameters, plane.settings)
    deadline = deadline_within(options.timeout_s)
    with admit(model):
        signature = plane.signature_of(model, deadline)
        prepare = request_images(plane, parsed, model, signature)
        wanted = wanted_outputs(parsed, signature)
        run = plane.run_images(model, prepare, deadline)
    return Inferred(model.name, run.version, parsed.id, output_tensors(run, wanted, model.labels, options))


def request_options(parameters: dict, settings) -> InferOptions:
    """Read the request's parameters: threshold, max_detections, Triton's timeout (microseconds) and priority."""
    known = {"threshold", "max_detections", "timeout", "priority"}
    for key in parameters:
        if key in SEQUENCE_PARAMETERS:
            raise BadRequest("sequence batching is not implemented: every request stands alone; drop sequence_id")
        if key not in known:
            raise InvalidParameter(f"unknown request parameter {key[:40]!r}; this server takes "
                                   f"{', '.join(sorted(known))}")
    threshold = parameters.get("threshold", settings.default_threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise InvalidParameter(f"the parameter threshold must be a number from 0 to 1, not {threshold!r:.40}")
    limit = parameters.get("max_detections", DEFAULT_MAX_DETECTIONS)
    if type(limit) is not int or not 1 <= limit <= MAX_DETECTIONS_LIMIT:
        raise InvalidParameter(f"the parameter max_detections must be an integer from 1 to {MAX_DETECTIONS_LIMIT}, "
                               f"not {limit!r:.40}")
    timeout_s = settings.request_deadline_s
    if "timeout" in parameters:
        timeout = parameters["timeout"]
        if type(timeout) is not int or timeout < 0:
            raise InvalidParameter("the parameter timeout must be a whole number of microseconds")
        if timeout > 0:
            timeout_s = min(timeout_s, timeout / 1e6)
    if "priority" in parameters and type(parameters["priority"]) is not int:
        raise InvalidParameter("the parameter priority must be an integer")
    return InferOptions(float(threshold), limit, timeout_s)


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
