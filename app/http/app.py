"""The Flask app factory: the routes over one data plane, the error handlers, the request's context and metrics."""

from __future__ import annotations

import logging
import time

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from ..cancellation import CANCELLATION_KEY
from ..errors import BadRequest, BodyTooLarge, InternalError, MethodNotAllowed, NotFound, RequestError
from ..protocol import context
from ..protocol.plane import DataPlane
from ..timeline import RECEIVED_KEY, TIMELINE_KEY, Timeline
from .access import refusal
from .errors import error_answer
from .headers import install_headers
from .paths import protocol_of
from .plane import EXTENSION, plane

log = logging.getLogger(__name__)


def create_app(data_plane: DataPlane) -> Flask:
    """Build the Flask app over the data plane; tests pass their own."""
    from .detect import routes as detect_routes
    from .models import routes as model_routes
    from .openapi import routes as openapi_routes
    from .ops import routes as ops_routes
    from .v1 import routes as v1_routes
    from .v2 import routes as v2_routes
    from .page import routes as page_routes
    from .video import routes as video_routes

    app = Flask(__name__, static_folder=None)  # the page serves its own files, by name (app/http/page.py)
    app.config["MAX_CONTENT_LENGTH"] = data_plane.settings.max_body_bytes
    app.json.sort_keys = False
    app.extensions[EXTENSION] = data_plane
    for blueprint in (detect_routes, video_routes, model_routes, ops_routes, v2_routes, v1_routes, openapi_routes, page_routes):
        app.register_blueprint(blueprint)
    app.register_error_handler(RequestError, _request_error)
    app.register_error_handler(HTTPException, _http_exception)
    app.register_error_handler(Exception, _unexpected_error)
    app.before_request(_start_timer)
    app.before_request(_check_access)
    app.after_request(_record_request)
    app.teardown_request(_end_context)
    install_headers(app, data_plane.settings.cors_origins)
    return app


def error_response(error: RequestError, extra_headers=()) -> Response:
    """Answer `error` in the current request's protocol."""
    answer = error_answer(error, protocol_of(request.path), extra_headers)
    return Response(answer.body, status=answer.status, headers=list(answer.headers))


ROUTES_HINT = ("/ (the page), /detect, /detect/video, /models, /models/<name>/detect, /models/<name>/detect/video, /gpu, /healthz, /readyz, /metrics, /openapi.json, "
               "/v2/... (KServe v2), /v1/models/... (TF Serving)")


def _request_error(error: RequestError):
    return error_response(error)


def _http_exception(error: HTTPException):
    # Werkzeug's own refusals (routing, the body limit) in the project's error tree.
    status = error.code or 500
    if status == 404:
        return error_response(NotFound(f"no route {request.path[:200]}; routes are {ROUTES_HINT}"))
    if status == 405:
        allow = [("Allow", ", ".join(error.valid_methods))] if getattr(error, "valid_methods", None) else []
        return error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.path[:200]}"), allow)
    if status == 413:
        return error_response(BodyTooLarge(
            f"the request body is over the limit of {plane().settings.max_body_bytes} bytes"))
    if 400 <= status < 500:
        return error_response(BadRequest(error.description or error.name))
    return _unexpected_error(error)


def _unexpected_error(error: Exception):
    log.error("unexpected error on %s %s", request.method, request.path[:200], exc_info=error)
    return error_response(InternalError("an internal error occurred; it has been logged"))


def _start_timer():
    g.started = time.perf_counter()
    # The I/O thread marks when the body began to arrive (app/hosting/site.py); what came before the
    # handler is the `receive` stage.
    timeline = Timeline(start=request.environ.get(RECEIVED_KEY))
    timeline.lap("receive")
    client = context.Client(request.remote_addr, {name.lower(): value for name, value in request.headers.items()})
    # The gateway sets it when the connection closes before the answer (app/hosting/wsgi.py); the test client has none.
    g.context_token = context.begin(timeline, client, request.environ.get(CANCELLATION_KEY))


def _check_access():
    refused = refusal(request.path, request.headers, request.remote_addr, plane().restrictions)
    if refused is not None:
        raise refused


def _record_request(response):
    rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
    model = context.model_name()
    plane().metrics.observe_request(rule, response.status_code, time.perf_counter() - g.get("started", 0.0), model)
    timeline = context.timeline()
    if timeline is not None and "decode" in timeline.seconds:  # the request ran images: its stages are recorded
        timeline.lap("encode")
        request.environ[TIMELINE_KEY] = (model, timeline)  # the I/O thread adds `write`, observes all
    plane().observe_statistics(answered=response.status_code < 400)
    return response


def _end_context(_error):
    token = g.pop("context_token", None)
    if token is not None:
        context.end(token)
