"""Model routes: GET /models and /models/<name>, and Triton's model-repository extension under /v2/repository.

The repository routes follow Triton's HTTP model-repository extension, so that tritonclient.http's
get_model_repository_index, load_model and unload_model work unmodified: index answers a JSON list of
{name, version, state, reason}; load and unload answer 200 with an empty body, or {"error": "..."}.
"""

from __future__ import annotations

import json

from flask import Blueprint, Response, g, jsonify, request

from ..errors import BadRequest
from .app import service

routes = Blueprint("models", __name__)

# Triton's repository index states.
_INDEX_STATES = {"ready": "READY", "loading": "LOADING", "unloading": "UNLOADING", "unloaded": "UNAVAILABLE",
                 "failed": "UNAVAILABLE"}


@routes.get("/models")
def list_models():
    models = service().models
    return jsonify({"models": models.describe(), "spares": models.spares(), "default_model": models.default_name()})


@routes.get("/models/<name>")
def one_model(name: str):
    models = service().models
    models.get(name)  # 404 model_not_found for an unknown name
    g.model = name
    return jsonify(models.describe([name])[0])


@routes.post("/v2/repository/index")
def repository_index():
    body = _json_body()
    return jsonify(index_rows(service().models, bool(body.get("ready", False))))


def index_rows(models, ready_only: bool) -> list[dict]:
    """The repository index, as Triton lists it: name, version, state, and the reason of one not ready."""
    rows = []
    for model in models.describe():
        state = _INDEX_STATES[model["state"]]
        if ready_only and state != "READY":
            continue
        row = {"name": model["name"], "version": model["version"] or "", "state": state}
        reason = model["reason"] or ("unloaded by request" if model["unloaded_by_request"] else "")
        if state != "READY" and reason:
            row["reason"] = reason
        rows.append(row)
    return rows


@routes.post("/v2/repository/models/<name>/load")
def repository_load(name: str):
    body = _json_body()
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadRequest("'parameters' must be a JSON object")
    check_load_parameters(parameters)
    g.model = name
    service().models.load(name)
    return Response(status=200)


@routes.post("/v2/repository/models/<name>/unload")
def repository_unload(name: str):
    _json_body()
    g.model = name
    service().models.unload(name)
    return Response(status=200)


def check_load_parameters(parameters) -> None:
    """Refuse Triton's load overrides (a config, model files in the request): models load as they are on disk."""
    overrides = sorted(key for key in parameters if key == "config" or key.startswith("file:"))
    if overrides:
        raise BadRequest(f"loading with {', '.join(overrides)} is not supported: this server loads model folders "
                         "as they are on disk")


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
