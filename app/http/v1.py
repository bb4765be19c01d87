"""TF Serving's REST API: model status, model metadata and predict, as TF Serving's own clients call them.

Routes: GET /v1/models/<name>[/versions/<v>] (status), GET .../metadata (the signature_def map),
POST /v1/models/<name>[/versions/<v>]:predict. Errors are `{"error": "<message>"}` with TF Serving's
status table (400 invalid argument, 404 not found, 503 unavailable, 504 deadline exceeded, 500 internal).
Outputs are the signature's four, named as it names them; the request's images join the same queue and
batches as /detect's.
"""

from __future__ import annotations

import time
from typing import Optional

from flask import Blueprint, g, jsonify, request

from ..errors import VersionNotFound
from ..inference.detections import stack_outputs
from .app import service
from .bodies import inflate
from .dataplane import (
    check_image_count, decode_files, requested_model, run_images, served_version, signature_of, tensor_images,
)
from .v1_codec import parse_predict, write_predictions

routes = Blueprint("v1", __name__)

# The registry's model states as TF Serving's ModelVersionStatus names them.
STATES = {"loading": "LOADING", "ready": "AVAILABLE", "unloading": "UNLOADING", "failed": "END"}


@routes.get("/v1/models/<name>")
@routes.get("/v1/models/<name>/versions/<version>")
def model_status(name: str, version: Optional[str] = None):
    models = service().models
    models.get(name)  # 404 for an unknown name
    g.model = name
    statuses = version_statuses(models.describe([name])[0])
    if version is not None:
        statuses = [s for s in statuses if s["version"] == version]
        if not statuses:
            raise VersionNotFound(f"model {name} has no version {version[:40]!r} that is loading, served or failed")
    return jsonify({"model_version_status": statuses})


@routes.get("/v1/models/<name>/metadata")
@routes.get("/v1/models/<name>/versions/<version>/metadata")
def model_metadata(name: str, version: Optional[str] = None):
    """The signature_def map, as TF Serving shows it; a model never loaded is loaded first (within the deadline)."""
    model = requested_model(name, version)
    signature_of(model, time.monotonic() + service().settings.request_deadline_s)
    return jsonify({
        "model_spec": {"name": model.name, "signature_name": "", "version": served_version(model)},
        "metadata": {"signature_def": {"signature_def": model.signature_defs or {}}},
    })


@routes.post("/v1/models/<name>:predict")
@routes.post("/v1/models/<name>/versions/<version>:predict")
def predict(name: str, version: Optional[str] = None):
    settings = service().settings
    model = requested_model(name, version)
    deadline = time.monotonic() + settings.request_deadline_s
    body = inflate(request.get_data(cache=False), request.headers.get("Content-Encoding"), settings.max_body_bytes)
    signature = signature_of(model, deadline)
    parsed = parse_predict(body, signature["input"]["name"])
    check_image_count(len(parsed.items), settings, "the request")
    pixels = {i: tensor_images(item.pixels[None], signature, settings, f"image {i}")[0]
              for i, item in enumerate(parsed.items) if item.pixels is not None}

    def prepare():
        return [pixels[i] if item.encoded is None else decode_files([item.encoded], model, settings)[0]
                for i, item in enumerate(parsed.items)]

    run = run_images(model, prepare, deadline)
    names = [out["name"] for out in signature["outputs"]]
    return jsonify(write_predictions(stack_outputs(run.outputs), names, parsed.row))


def version_statuses(described: dict) -> list[dict]:
    """The model_version_status list from a model's description (GET /models/<name>'s), newest version first.

    Versions loading, served or failed are listed as TF Serving lists them. A model with none of those (not
    loaded yet, or unloaded when idle) lists the version it would load as START, since its next request loads
    it; one unloaded by request lists it as END.
    """
    statuses = []
    for entry in sorted(described["versions"], key=lambda v: int(v["version"]), reverse=True):
        state = STATES.get(entry["state"])
        if state is None:
            continue
        error = entry.get("reason") or (described["reason"] if entry["state"] == "failed" else None)
        statuses.append(_status(entry["version"], state, error))
    if not statuses and described["versions"]:
        latest = max(described["versions"], key=lambda v: int(v["version"]))["version"]
        statuses.append(_status(latest, "END" if described["unloaded_by_request"] else "START", None))
    return statuses


def _status(version: str, state: str, error: Optional[str]) -> dict:
    return {"version": version, "state": state,
            "status": {"error_code": "UNKNOWN" if error else "OK", "error_message": error or ""}}

