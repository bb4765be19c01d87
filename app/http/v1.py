"""TF Serving's REST API: model status, model metadata and predict, as TF Serving's own clients call them.

Routes: GET /v1/models/<name>[/versions/<v>] (status), GET .../metadata (the signature_def map),
POST /v1/models/<name>[/versions/<v>]:predict. Errors are `{"error": "<message>"}` with TF Serving's
status table (400 invalid argument, 404 not found, 503 unavailable, 504 deadline exceeded, 500 internal).
Outputs are the signature's four, named as it names them; the request's images join the same queue and
batches as /detect's. The logic shared with TF Serving's gRPC API is app/protocol/v1.py.
"""

from __future__ import annotations

from typing import Optional

from flask import Blueprint, jsonify, request

from ..protocol import v1
from ..protocol.bodies import inflate
from ..protocol.plane import served_version
from ..protocol.v1_codec import parse_predict, write_predictions
from .plane import plane

routes = Blueprint("v1", __name__)


@routes.get("/v1/models/<name>")
@routes.get("/v1/models/<name>/versions/<version>")
def model_status(name: str, version: Optional[str] = None):
    data_plane = plane()
    data_plane.model(name)  # 404 for an unknown name
    shown = None if version is None else repr(version[:40])
    return jsonify({"model_version_status": v1.model_statuses(data_plane, name, version, shown)})


@routes.get("/v1/models/<name>/metadata")
@routes.get("/v1/models/<name>/versions/<version>/metadata")
def model_metadata(name: str, version: Optional[str] = None):
    """The signature_def map, as TF Serving shows it; a model never loaded is loaded first (within the deadline)."""
    data_plane = plane()
    model = data_plane.model(name, version)
    data_plane.signature_of(model, data_plane.deadline())
    return jsonify({
        "model_spec": {"name": model.name, "signature_name": "", "version": served_version(model)},
        "metadata": {"signature_def": {"signature_def": model.signature_defs or {}}},
    })


@routes.post("/v1/models/<name>:predict")
@routes.post("/v1/models/<name>/versions/<version>:predict")
def predict(name: str, version: Optional[str] = None):
    data_plane = plane()
    model = data_plane.model(name, version)
    deadline = data_plane.deadline()
    body = inflate(request.get_data(cache=False), request.headers.get("Content-Encoding"),
                   data_plane.settings.max_body_bytes)

    parsed = None

    def read_images(signature: dict):
        nonlocal parsed
        parsed = parse_predict(body, signature["input"]["name"])
        data_plane.check_image_count(len(parsed.items), "the request")
        pixels = {i: data_plane.tensor_images(item.pixels[None], signature, f"image {i}")[0]
                  for i, item in enumerate(parsed.items) if item.pixels is not None}
        return lambda: [pixels[i] if item.encoded is None else data_plane.decode_files([item.encoded], model)[0]
                        for i, item in enumerate(parsed.items)]

    _, arrays, names = v1.predict(data_plane, model, deadline, read_images)
    return jsonify(write_predictions(arrays, names, parsed.row))
