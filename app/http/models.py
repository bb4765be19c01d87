"""Model routes: GET /models and /models/<name>, and Triton's model-repository extension under /v2/repository.

The repository routes follow Triton's HTTP model-repository extension, so that tritonclient.http's
get_model_repository_index, load_model and unload_model work unmodified: index answers a JSON list of
{name, version, state, reason}; load and unload answer 200 with an empty body, or {"error": "..."}. The
extension's logic, shared with gRPC, is app/protocol/repository.py.
"""

from __future__ import annotations

import json

from flask import Blueprint, Response, jsonify, request

from ..errors import BadRequest
from ..protocol import repository
from .plane import plane

routes = Blueprint("models", __name__)


@routes.get("/models")
def list_models():
    models = plane().models
    return jsonify({"models": models.describe(), "spares": models.spares(), "default_model": models.default_name()})


@routes.get("/models/<name>")
def one_model(name: str):
    data_plane = plane()
    data_plane.model(name)  # 404 model_not_found for an unknown name
    return jsonify(data_plane.models.describe([name])[0])


@routes.post("/v2/repository/index")
def repository_index():
    body = _json_body()
    return jsonify(repository.index_rows(plane(), bool(body.get("ready", False))))


@routes.post("/v2/repository/models/<name>/load")
def repository_load(name: str):
    body = _json_body()
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadRequest("'parameters' must be a JSON object")
    repository.load(plane(), name, parameters)
    return Response(status=200)


@routes.post("/v2/repository/models/<name>/unload")
def repository_unload(name: str):
    _json_body()
    repository.unload(plane(), name)
    return Response(status=200)


def _json_body() -> dict:
    data = request.get_data(cache=False)
    if not data.strip():
        return {}
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise BadRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body
