"""The Flask app: a thin HTTP layer that parses, delegates to the detector, and serializes."""

from __future__ import annotations

import logging
import time

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException

from .detect_request import check_raw_type, images_from_json, media_type, parse_params, RAW_IMAGE_TYPES
from .errors import (
    DetectError, InferenceFailed, InvalidBody, NotReady, RequestError, error_body, http_status,
)
from .gpu_report import GpuReport
from .images import decode_image
from .metrics import ServiceMetrics
from .settings import Settings
from .state import ServingState

log = logging.getLogger(__name__)

routes = Blueprint("detect", __name__)

# Werkzeug's own HTTP errors (routing, body limit) mapped into our slugs.
_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


class Service:
    """What the routes need, attached to the app as app.extensions['detect']."""

    def __init__(self, settings: Settings, state: ServingState, gpu: GpuReport, metrics: ServiceMetrics):
        self.settings = settings
        self.state = state
        self.gpu = gpu
        self.metrics = metrics


def create_app(settings: Settings, state: ServingState, gpu: GpuReport,
               metrics: ServiceMetrics | None = None) -> Flask:
    """Build the Flask app around its collaborators; tests pass their own."""
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False
    app.extensions["detect"] = Service(settings, state, gpu, metrics or ServiceMetrics(gpu))
    app.register_blueprint(routes)
    app.register_error_handler(RequestError, _request_error)
    app.register_error_handler(HTTPException, _http_exception)
    app.register_error_handler(Exception, _unexpected_error)
    app.before_request(_start_timer)
    app.after_request(_record_request)
    return app


def _service() -> Service:
    return current_app.extensions["detect"]


@routes.post("/detect")
def detect():
    service = _service()
    detector = service.state.detector
    if detector is None:
        raise NotReady("the model is not loaded yet")
    settings = service.settings
    started = time.perf_counter()
    deadline = time.monotonic() + settings.request_deadline_s
    params = parse_params(request.args, settings.default_threshold)
    blobs, plural = _image_blobs(settings.max_images_per_request)
    images = [decode_image(blob, settings.max_image_pixels) for blob in blobs]
    decoded = time.perf_counter()
    try:
        results = detector.detect([image.pixels for image in images], params.threshold, params.max_detections,
                                  deadline=deadline)
    except DetectError:
        raise
    except Exception as exc:
        log.exception("inference failed for a request of %d image(s)", len(images))
        raise InferenceFailed(f"the model failed on this request: {type(exc).__name__}") from None
    finished = time.perf_counter()
    timing = {
        "decode": round((decoded - started) * 1000, 2),
        "inference": round((finished - decoded) * 1000, 2),
        "total": round((finished - started) * 1000, 2),
    }
    answers = [
        {"width": image.width, "height": image.height, "detections": [d.to_json() for d in found]}
        for image, found in zip(images, results)
    ]
    model = {"name": detector.name, "version": detector.version}
    if len(answers) == 1 and not plural:
        return jsonify({"model": model, **answers[0], "timing_ms": timing})
    return jsonify({"model": model, "results": answers, "timing_ms": timing})


def _image_blobs(limit: int) -> tuple[list[bytes], bool]:
    """Return the request's image bytes, and whether the client sent a list ("images")."""
    kind = media_type(request.content_type)
    check_raw_type(kind)
    plural = False
    if kind in RAW_IMAGE_TYPES:
        blobs = [request.get_data(cache=False)]
    elif kind == "multipart/form-data":
        files = request.files.getlist("image")
        if not files:
            fields = sorted(set(request.files) | set(request.form))
            raise InvalidBody(
                "the multipart body has no 'image' file field"
                + (f" (it has {', '.join(repr(f) for f in fields[:5])})" if fields else "")
            )
        blobs = [f.read() for f in files]
    else:
        blobs, plural = images_from_json(request.get_data(cache=False))
    if len(blobs) > limit:
        raise InvalidBody(f"the request has {len(blobs)} images; at most {limit} are accepted")
    return blobs, plural


@routes.get("/gpu")
def gpu():
    return jsonify(_service().gpu.to_json())


@routes.get("/healthz")
def healthz():
    return jsonify({"status": "ok"})


@routes.get("/readyz")
def readyz():
    state = _service().state
    detector = state.detector
    if not state.ready:
        raise NotReady("the server is shutting down" if state.draining else "the model is loading")
    return jsonify({"status": "ready", "model": {"name": detector.name, "version": detector.version}})


@routes.get("/metrics")
def metrics():
    return Response(_service().metrics.render(), mimetype="text/plain; version=0.0.4")


def _error_response(status: int, code: str, message: str, headers=None):
    response = jsonify(error_body(code, message))
    response.status_code = status
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response


def _request_error(error: RequestError):
    retry_after = getattr(error, "retry_after_s", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return _error_response(http_status(error), error.code, error.message, headers)


def _http_exception(error: HTTPException):
    status = error.code or 500
    headers = {}
    if status == 405 and getattr(error, "valid_methods", None):
        headers["Allow"] = ", ".join(error.valid_methods)
    message = {
        404: f"no route {request.path}; routes are /detect, /gpu, /healthz, /readyz, /metrics",
        405: f"{request.method} is not allowed on {request.path}",
        413: f"the request body is over the limit of {_service().settings.max_body_bytes} bytes",
    }.get(status, error.description or error.name)
    return _error_response(status, _HTTP_CODES.get(status, error.name.lower().replace(" ", "_")), message, headers)


def _unexpected_error(error: Exception):
    log.exception("unexpected error on %s %s", request.method, request.path)
    return _error_response(500, "internal", "an internal error occurred; it has been logged")


def _start_timer():
    g.started = time.perf_counter()


def _record_request(response):
    rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
    _service().metrics.observe_request(rule, response.status_code, time.perf_counter() - g.get("started", 0.0))
    return response
