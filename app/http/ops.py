"""Operations routes: /healthz, /readyz, /gpu and /metrics."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from ..errors import NotReady
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


@routes.get("/metrics")
def metrics():
    return Response(service().metrics.render(), mimetype="text/plain; version=0.0.4")
