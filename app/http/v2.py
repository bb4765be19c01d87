"""KServe v2 / Open Inference Protocol over HTTP, as Triton serves it and tritonclient.http drives it.

Routes: GET /v2 (server metadata), /v2/health/live, /v2/health/ready, /v2/models/<name>[/versions/<v>]
(model metadata), .../ready, and POST .../infer. One version of a model is served at a time: a path naming
another version answers 404. Errors are `{"error": "<message>"}` with Triton's status codes; the health and
readiness routes answer 200 or 400 (the protocol's rule, which Triton's clients read) with a body as KServe's
server writes it (`{"live": true}`, `{"ready": ...}`, `{"name": ..., "ready": ...}`, which KServe's SDK reads). The protocol's logic (inputs, outputs, parameters,
metadata) is app/protocol/v2.py, shared with gRPC; this module reads the HTTP request and writes the answer
(JSON, or Triton's binary tensor extension, app/protocol/v2_codec.py).
"""

from __future__ import annotations

from typing import Optional

from flask import Blueprint, Response, jsonify, request

from ..errors import InvalidBody, Unimplemented
from ..protocol import v2
from ..protocol.bodies import inflate, json_object
from ..protocol.v2_codec import HEADER_LENGTH, parse_infer_request, write_infer_response
from .plane import plane

routes = Blueprint("v2", __name__)


@routes.get("/v2")
def server_metadata():
    return jsonify(v2.server_metadata(plane()))


@routes.get("/v2/health/live")
def live():
    return jsonify({"live": True})


@routes.get("/v2/health/ready")
def ready():
    """200 once every preloaded model has loaded (and none failed), until shutdown begins; else 400."""
    ready = plane().ready()
    return jsonify({"ready": ready}), 200 if ready else 400


@routes.get("/v2/models/<name>")
@routes.get("/v2/models/<name>/versions/<version>")
def model_metadata(name: str, version: Optional[str] = None):
    """The signature as the model declares it; a model never loaded is loaded first (within the deadline)."""
    data_plane = plane()
    model = data_plane.model(name, version)
    return jsonify(v2.model_metadata(data_plane, model, data_plane.deadline()))


@routes.get("/v2/models/<name>/config")
@routes.get("/v2/models/<name>/versions/<version>/config")
def model_config(name: str, version: Optional[str] = None):
    """The model's configuration in Triton's JSON form, as tritonclient's get_model_config and perf_analyzer read it."""
    data_plane = plane()
    model = data_plane.model(name, version)
    return jsonify(v2.model_config(data_plane, model, v2.model_metadata(data_plane, model, data_plane.deadline())))


@routes.get("/v2/models/stats")
@routes.get("/v2/models/<name>/stats")
@routes.get("/v2/models/<name>/versions/<version>/stats")
def model_statistics(name: Optional[str] = None, version: Optional[str] = None):
    """Triton's statistics: every model's, or one model's, as perf_analyzer reads them to split the server's time."""
    return jsonify(v2.statistics(plane(), name, version))


@routes.post("/v2/systemsharedmemory/region/<region>/register")
def register_shared_memory(region: str):
    """Register a POSIX shared-memory region by name: {"key", "offset", "byte_size"}; 200 with an empty body."""
    body = json_object(request.get_data(cache=False), "the registration", "a JSON object: key, offset, byte_size")
    unknown = sorted(set(body) - {"key", "offset", "byte_size"})
    if unknown:
        raise InvalidBody(f"the registration has an unknown field {unknown[0][:40]!r}; it takes key, offset, byte_size")
    plane().shared_memory.register(region, body.get("key"), body.get("offset", 0), body.get("byte_size"))
    return Response(status=200)


@routes.get("/v2/systemsharedmemory/status")
@routes.get("/v2/systemsharedmemory/region/<region>/status")
def shared_memory_status(region: Optional[str] = None):
    """The registered regions (or the one named): name, key, offset, byte_size."""
    return jsonify(plane().shared_memory.status(region))


@routes.post("/v2/systemsharedmemory/unregister")
@routes.post("/v2/systemsharedmemory/region/<region>/unregister")
def unregister_shared_memory(region: Optional[str] = None):
    """Unregister one region, or every one; a request using it keeps it until answered. 200 with an empty body."""
    plane().shared_memory.unregister(region)
    return Response(status=200)


@routes.get("/v2/models/<name>/ready")
@routes.get("/v2/models/<name>/versions/<version>/ready")
def model_ready(name: str, version: Optional[str] = None):
    """200 while the model is loaded and ready; 400 while it is unloaded, loading, unloading or failed."""
    model = plane().model(name, version)
    ready = v2.model_ready(model)
    return jsonify({"name": model.name, "ready": ready}), 200 if ready else 400


@routes.post("/v2/models/<name>/infer")
@routes.post("/v2/models/<name>/versions/<version>/infer")
def infer(name: str, version: Optional[str] = None):
    data_plane = plane()
    model = data_plane.model(name, version)
    body = inflate(request.get_data(cache=False), request.headers.get("Content-Encoding"),
                   data_plane.settings.max_body_bytes)
    parsed = parse_infer_request(body, request.headers.get(HEADER_LENGTH))
    wanted_version = v2.check_named_model(parsed, name, version)
    if wanted_version != version:
        data_plane.model(name, wanted_version)  # 404 for a version the body names that is not served
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


# Triton's extensions this server does not implement: each route answers 400 naming its extension, as Triton
# answers the routes of an extension it was started without, and never 404 "no route".
UNIMPLEMENTED_EXTENSIONS = {
    "CUDA shared memory": tuple(f"/v2/cudasharedmemory{region}/{verb}" for region in ("", "/region/<region>")
                                for verb in ("status", "register", "unregister")),
    "trace": ("/v2/trace/setting", "/v2/models/<name>/trace/setting"),
    "logging": ("/v2/logging",),
}


def _refuse_extension(extension: str):
    def refuse(**_path):
        raise Unimplemented(f"the {extension} extension is not implemented by this server")

    return refuse


for _extension, _paths in UNIMPLEMENTED_EXTENSIONS.items():
    for _path in _paths:
        routes.add_url_rule(_path, endpoint=f"unimplemented {_path}", view_func=_refuse_extension(_extension),
                            methods=["GET", "POST"])
