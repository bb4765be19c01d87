"""KServe v2 / Open Inference Protocol over HTTP, as Triton serves it and tritonclient.http drives it.

Routes: GET /v2 (server metadata), /v2/health/live, /v2/health/ready, /v2/models/<name>[/versions/<v>]
(model metadata), .../ready, and POST .../infer. One version of a model is served at a time: a path naming
another version answers 404. Errors are `{"error": "<message>"}` with Triton's status codes; the health and
readiness routes answer 200 or 400 with an empty body.

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
import time
from dataclasses import dataclass
from typing import Callable, Optional

from flask import Blueprint, Response, jsonify, request

from ..errors import BadRequest, InvalidBody, InvalidParameter
from ..inference.detections import DEFAULT_MAX_DETECTIONS, MAX_DETECTIONS_LIMIT, stack_outputs, to_detections
from ..inference.images import DecodedImage
from .app import SERVER_NAME, server_version, service
from .bodies import decode_base64, inflate
from .dataplane import encoded_images, requested_model, run_images, served_version, signature_of, tensor_images
from .v2_codec import HEADER_LENGTH, InferRequest, Tensor, parse_infer_request, write_infer_response

routes = Blueprint("v2", __name__)

EXTENSIONS = ("binary_tensor_data", "model_repository", "parameters")
PLATFORM = "tensorflow_savedmodel"
IMAGE_INPUT = "image"
DETECTIONS_OUTPUT = "detections"
DATATYPES = {"uint8": "UINT8", "float32": "FP32", "string": "BYTES"}  # TensorFlow's names -> the protocol's
# Request parameters Triton defines for its sequence batcher, which this server does not have.
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


@routes.get("/v2")
def server_metadata():
    return jsonify({"name": SERVER_NAME, "version": server_version(), "extensions": list(EXTENSIONS)})


@routes.get("/v2/health/live")
def live():
    return _empty(200)


@routes.get("/v2/health/ready")
def ready():
    """200 once every preloaded model has loaded (and none failed), until shutdown begins; else 400."""
    svc = service()
    draining = svc.lifecycle is not None and svc.lifecycle.draining
    return _empty(200 if svc.models.ready and not draining else 400)


@routes.get("/v2/models/<name>")
@routes.get("/v2/models/<name>/versions/<version>")
def model_metadata(name: str, version: Optional[str] = None):
    """The signature as the model declares it; a model never loaded is loaded first (within the deadline)."""
    model = requested_model(name, version)
    signature = signature_of(model, time.monotonic() + service().settings.request_deadline_s)
    return jsonify(describe(model, signature))


@routes.get("/v2/models/<name>/ready")
@routes.get("/v2/models/<name>/versions/<version>/ready")
def model_ready(name: str, version: Optional[str] = None):
    """200 while the model is loaded and ready; 400 while it is unloaded, loading, unloading or failed."""
    model = requested_model(name, version)
    return _empty(200 if model.state == "ready" else 400)


@routes.post("/v2/models/<name>/infer")
@routes.post("/v2/models/<name>/versions/<version>/infer")
def infer(name: str, version: Optional[str] = None):
    settings = service().settings
    model = requested_model(name, version)
    body = inflate(request.get_data(cache=False), request.headers.get("Content-Encoding"), settings.max_body_bytes)
    parsed = parse_infer_request(body, request.headers.get(HEADER_LENGTH))
    options = request_options(parsed.parameters, settings)
    deadline = time.monotonic() + options.timeout_s
    signature = signature_of(model, deadline)
    prepare = request_images(parsed, model, signature, settings)
    wanted = wanted_outputs(parsed, signature)
    run = run_images(model, prepare, deadline)
    tensors = output_tensors(run, wanted, model.labels, options)
    answer, header_length = write_infer_response(model.name, run.version, parsed.id, tensors)
    response = Response(answer, status=200)
    if header_length is None:
        response.content_type = "application/json"
    else:
        response.content_type = "application/octet-stream"
        response.headers[HEADER_LENGTH] = str(header_length)
    return response


# Metadata ---------------------------------------------------------------------------------------------


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


def _empty(status: int) -> Response:
    response = Response(status=status)
    del response.headers["Content-Type"]
    return response


# Inference, shared with the gRPC service (app/grpc/kserve.py) ------------------------------------------


@dataclass(frozen=True)
class InferOptions:
    threshold: float
    max_detections: int
    timeout_s: float


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


def request_images(parsed: InferRequest, model, signature: dict, settings) -> Callable[[], list[DecodedImage]]:
    """Check the request's one input against the model; return what decodes it (run after admission)."""
    declared = signature["input"]
    encoded_model = declared["dtype"] == "string"
    if parsed.raw is not None:
        return lambda: encoded_images([parsed.raw], model, settings, "the raw request body")
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
        return lambda: encoded_images(blobs, model, settings, where)
    if tensor.name != declared["name"]:
        raise InvalidBody(f"unknown input {tensor.name!r}; model inputs are {declared['name']!r} and {IMAGE_INPUT!r}")
    allowed = ("UINT8", "FP32") if declared["dtype"] == "float32" else ("UINT8",)
    if tensor.datatype not in allowed:
        raise InvalidBody(f"{where} has datatype {tensor.datatype}; the model takes {' or '.join(allowed)}")
    images = tensor_images(tensor.data, signature, settings, where)
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


def output_tensors(run, wanted: list[tuple[str, bool]], labels: dict, options: InferOptions) -> list[tuple[Tensor, bool]]:
    arrays = stack_outputs(run.outputs)
    tensors = []
    for name, binary in wanted:
        if name == DETECTIONS_OUTPUT:
            answers = [json.dumps({"width": image.width, "height": image.height, "detections": [
                d.to_json() for d in to_detections(out, image.width, image.height, labels, options.threshold,
                                                   options.max_detections)]}, separators=(",", ":")).encode()
                       for image, out in zip(run.images, run.outputs)]
            tensors.append((Tensor(name, "BYTES", (len(answers),), answers), binary))
        else:
            tensors.append((Tensor(name, "FP32", arrays[name].shape, arrays[name]), binary))
    return tensors
