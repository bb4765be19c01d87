"""Operations routes: /healthz, /readyz, /gpu, /gpu/history and /metrics."""

from __future__ import annotations

import math

from flask import Blueprint, Response, jsonify, request

from ..errors import InvalidParameter, NotReady
from .app import service

routes = Blueprint("ops", __name__)


@routes.get("/healthz")
def healthz():
    return jsonify({"status": "ok"})


@routes.get("/readyz")
def readyz():
    """200 once every preloaded model has loaded (and none failed), until shutdown begins."""
    svc = service()
    if svc.lifecycle is not None and svc.lifecycle.draining:
        raise NotReady("the server is shutting down")
    if not svc.models.ready:
        raise NotReady("the models are loading" if svc.models.boot_failure() is None
                       else f"a preloaded model failed: {svc.models.boot_failure()}")
    return jsonify({"status": "ready", "models": [
        {"name": m["name"], "version": m["version"], "state": m["state"]} for m in svc.models.describe()]})


@routes.get("/gpu")
def gpu():
    return jsonify(service().gpu.to_json())


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
    return jsonify(service().models.history.to_json(since))


@routes.get("/metrics")
def metrics():
    return Response(service().metrics.render(), mimetype="text/plain; version=0.0.4")
