"""KServe v2 / Open Inference Protocol over HTTP, as Triton serves it and tritonclient.http drives it.

Routes: GET /v2 (server metadata), /v2/health/live, /v2/health/ready, /v2/models/<name>[/versions/<v>]
(model metadata), .../ready, and POST .../infer. One version of a model is served at a time: a path naming
another version answers 404. Errors are `{"error": "<message>"}` with Triton's status codes; the health and
readiness routes answer 200 or 400 with an empty body. The protocol's logic (inputs, outputs, parameters,
metadata) is app/protocol/v2.py, shared with gRPC; this module reads the HTTP request and writes the answer
(JSON, or Triton's binary tensor extension, app/protocol/v2_codec.py).
"""

from __future__ import annotations

from typing import Optional

from flask import Blueprint, Response, jsonify, request

from ..protocol import v2
from ..protocol.bodies import inflate
from ..protocol.v2_codec import HEADER_LENGTH, parse_infer_request, write_infer_response
from .plane import plane

routes = Blueprint("v2", __name__)


@routes.get("/v2")
def server_metadata():
    return jsonify(v2.server_metadata(plane()))


@routes.get("/v2/health/live")
def live():
    return _empty(200)


@routes.get("/v2/health/ready")
def ready():
    """200 once every preloaded model has loaded (and none failed), until shutdown begins; else 400."""
    return _empty(200 if plane().ready() else 400)


@routes.get("/v2/models/<name>")
@routes.get("/v2/models/<name>/versions/<version>")
def model_metadata(name: str, version: Optional[str] = None):
    """The signature as the model declares it; a model never loaded is loaded first (within the deadline)."""
    data_plane = plane()
    model = data_plane.model(name, version)
    return jsonify(v2.model_metadata(data_plane, model, data_plane.deadline()))


@routes.get("/v2/models/<name>/ready")
@routes.get("/v2/models/<name>/versions/<version>/ready")
def model_ready(name: str, version: Optional[str] = None):
    """200 while the model is loaded and ready; 400 while it is unloaded, loading, unloading or failed."""
    return _empty(200 if v2.model_ready(plane().model(name, version)) else 400)


@routes.post("/v2/models/<name>/infer")
@routes.post("/v2/models/<name>/versions/<version>/infer")
def infer(name: str, version: Optional[str] = None):
    data_plane = plane()
    model = data_plane.model(name, version)
    body = inflate(request.get_data(cache=False), request.headers.get("Content-Encoding"),
                   data_plane.settings.max_body_bytes)
    parsed = parse_infer_request(body, request.headers.get(HEADER_LENGTH))
    inferred = v2.infer(data_plane, model, parsed, data_plane.deadline)
    answer, header_length = write_infer_response(inferred.model_name, inferred.version, inferred.request_id,
                                                 inferred.tensors)
    response = Response(answer, status=200)
    if header_length is None:
        response.content_type = "application/json"
    else:
        response.content_type = "application/octet-stream"
        response.headers[HEADER_LENGTH] = str(header_length)
    return response


def _empty(status: int) -> Response:
    response = Response(status=status)
    del response.headers["Content-Type"]
    return response
