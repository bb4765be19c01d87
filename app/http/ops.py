"""Operations routes: /healthz, /readyz, /gpu, /gpu/history and /metrics."""

from __future__ import annotations

import math

from flask import Blueprint, Response, jsonify, request

from ..errors import InvalidParameter
from .plane import plane

routes = Blueprint("ops", __name__)


@routes.get("/healthz")
def healthz():
    return jsonify({"status": "ok"})


@routes.get("/readyz")
def readyz():
    """200 once every preloaded model has loaded (and none failed), until shutdown begins."""
    data_plane = plane()
    not_ready = data_plane.not_ready()
    if not_ready is not None:
        raise not_ready
    return jsonify({"status": "ready", "models": [
        {"name": m["name"], "version": m["version"], "state": m["state"]} for m in data_plane.models.describe()]})


@routes.get("/gpu")
def gpu():
    return jsonify(plane().gpu.to_json())


@routes.get("/gpu/history")
def gpu_history():
    """The last minutes of memory per model, the HTTP process and the spares, as the server sampled them."""
    unknown = sorted(set(request.args) - {"since"})
    if unknown:
        raise InvalidParameter(f"unknown query parameter {unknown[0][:40]!r}; /gpu/history takes since")
    since = request.args.get("since")
    if since is not None:
        try:
            value = float(since)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise InvalidParameter(f"since must be a unix time in seconds, not {since[:40]!r}")
        since = value
    return jsonify(plane().models.history.to_json(since))


@routes.get("/metrics")
def metrics():
    return Response(plane().metrics.render(), mimetype="text/plain; version=0.0.4")
