"""GET /openapi.json: an OpenAPI 3.1 description of every route, this service's own, KServe v2 and TF Serving.

Built in code at each request, so that the model-name parameters list the models this server holds (an
enum: any other name is 404). Each protocol's operations carry that protocol's error body.
"""

from __future__ import annotations

from flask import Blueprint, jsonify

from ..inference.detections import DEFAULT_MAX_DETECTIONS, MAX_DETECTIONS_LIMIT
from ..protocol.plane import SERVER_NAME, server_version
from ..protocol.v2_codec import DATATYPES, HEADER_LENGTH
from ..vision.video import VIDEO_TYPES
from .detect_request import MAX_SIDE_LIMIT
from .plane import plane

routes = Blueprint("openapi", __name__)

OPENAPI_VERSION = "3.1.0"
IMAGE_TYPES = ("image/jpeg", "image/png", "image/webp", "image/bmp", "image/gif")


@routes.get("/openapi.json")
def openapi_document():
    return jsonify(document(plane().models.names(), server_version(), SERVER_NAME))


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _empty(description: str) -> dict:
    return {"description": description}


def _errors(schema: str, statuses: dict[int, str]) -> dict:
    """Error responses of one protocol; `default` covers the rest (405, 413, 431 from the transport)."""
    responses = {str(status): _json(_ref(schema), text) for status, text in statuses.items()}
    responses["default"] = _json(_ref(schema), "any other error, in the same shape")
    return responses


def _retry(response: dict) -> dict:
    response = dict(response)
    response["headers"] = {"Retry-After": {"description": "seconds to wait before retrying (overload)",
                                           "schema": {"type": "string"}}}
    return response


def _path_param(name: str, schema: dict, description: str) -> dict:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": schema}


DETECT_ERRORS = {400: "bad input: image, parameter or body", 404: "no such model or route",
                 413: "body or image over its limit", 415: "a content type or image format not accepted",
                 500: "the model failed on this request", 503: "not ready, overloaded, or out of memory",
                 504: "no answer within the request deadline"}
V2_ERRORS = {400: "bad request", 404: "unknown model, version or route", 413: "body over max_body_bytes, "
             "compressed or inflated", 500: "internal error", 503: "not ready, overloaded or timed out"}
V1_ERRORS = {400: "invalid argument", 404: "not found", 413: "body over max_body_bytes", 429: "out of memory",
             500: "internal", 503: "unavailable", 504: "deadline exceeded"}


def _schemas() -> dict:
    number, integer, string = {"type": "number"}, {"type": "integer"}, {"type": "string"}
    nullable_string = {"type": ["string", "null"]}
    tensor_meta = {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
        "name": string, "datatype": string, "shape": {"type": "array", "items": integer}}}
    parameters = {"type": "object", "additionalProperties": {"type": ["boolean", "number", "string"]}}
    return {
        "DetectError": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["code", "message"], "properties": {"code": string, "message": string}}}},
        "ProtocolError": {"type": "object", "required": ["error"], "properties": {"error": string},
                          "description": "the error body of the v2 and v1 protocols"},
        "Detection": {"type": "object", "required": ["label", "class_id", "score", "box"], "properties": {
            "label": string, "class_id": integer, "score": number,
            "box": {"type": "object", "required": ["x_min", "y_min", "x_max", "y_max"], "properties": {
                k: number for k in ("x_min", "y_min", "x_max", "y_max")},
                "description": "pixels of the image as displayed (EXIF orientation applied)"}}},
        "TrackedDetection": {"allOf": [_ref("Detection"), {"type": "object", "required": ["track_id"], "properties": {
            "track_id": {"type": ["integer", "null"], "description": "the object's identity in this video, from 1; "
                         "null while its track is not yet confirmed (its first frame)"}}}]},
        "VideoRecord": {"description": "one line of the NDJSON answer: the video first, then a record per sampled "
                        "frame, then the end, or an error that ends the stream", "oneOf": [
            {"type": "object", "required": ["video"], "properties": {"video": {"type": "object", "properties": {
                "model": {"type": "object"}, "container": string, "codec": string, "width": integer,
                "height": integer, "fps": number, "duration_s": number, "frames": integer, "sampled_fps": number}}}},
            {"type": "object", "required": ["frame", "time_s", "detections"], "properties": {
                "frame": {"type": "integer", "description": "the frame's index in the video, from 0"},
                "time_s": {"type": "number", "description": "from the first frame"},
                "detections": {"type": "array", "items": _ref("TrackedDetection")}}},
            {"type": "object", "required": ["end"], "properties": {"end": {"type": "object", "properties": {
                "frames": integer, "tracks": integer, "timing_ms": {"type": "object"}}}}},
            {"type": "object", "required": ["error", "frames"], "properties": {
                "error": {"type": "object", "properties": {"code": string, "message": string}},
                "frames": {"type": "integer", "description": "the frames answered before it"}}}]},
        "ImageResult": {"type": "object", "required": ["width", "height", "detections"], "properties": {
            "width": integer, "height": integer, "detections": {"type": "array", "items": _ref("Detection")}}},
        "DetectAnswer": {"type": "object", "required": ["model", "timing_ms"], "properties": {
            "model": {"type": "object", "required": ["name", "version"], "properties": {
                "name": string, "version": nullable_string}},
            "width": integer, "height": integer, "detections": {"type": "array", "items": _ref("Detection")},
            "results": {"type": "array", "items": _ref("ImageResult")},
            "timing_ms": {"type": "object", "additionalProperties": number, "properties": {
                "stages": {"type": "object", "additionalProperties": number,
                           "description": "with timing=stages: milliseconds by stage (app/timeline.py)"}}}},
            "description": "one image: width, height and detections; several (or the JSON 'images' list): results"},
        "Model": {"type": "object", "required": ["name", "state", "version", "versions"], "properties": {
            "name": string, "state": {"enum": ["unloaded", "loading", "ready", "unloading", "failed"]},
            "reason": nullable_string, "version": nullable_string,
            "versions": {"type": "array", "items": {"type": "object", "required": ["version", "state"],
                                                    "properties": {"version": string, "state": string,
                                                                   "reason": string}}},
            "pid": {"type": ["integer", "null"]}, "signature": {"type": ["object", "null"]},
            "memory": {"type": ["object", "null"]},
            "labels": {"type": "array", "items": string,
                       "description": "what the model finds: its label map's names in id order, once loaded"}}},
        "ServerMetadata": {"type": "object", "required": ["name", "version", "extensions"], "properties": {
            "name": string, "version": string, "extensions": {"type": "array", "items": string}}},
        "TensorMetadata": tensor_meta,
        "ModelMetadata": {"type": "object", "required": ["name", "versions", "platform", "inputs", "outputs"],
                          "properties": {
                              "name": string, "versions": {"type": "array", "items": string}, "platform": string,
                              "inputs": {"type": "array", "items": _ref("TensorMetadata")},
                              "outputs": {"type": "array", "items": _ref("TensorMetadata")},
                              "parameters": {"type": "object", "description": "input_type (the export's); "
                                             "extra_inputs (image: encoded files) and extra_outputs (detections: "
                                             "/detect's answer per image as JSON)"}}},
        "Parameters": parameters,
        "InferInput": {"type": "object", "required": ["name", "shape", "datatype"], "additionalProperties": False,
                       "properties": {
                           "name": {"type": "string", "minLength": 1, "maxLength": 256}, "shape": {"type": "array", "items": {"type": "integer", "minimum": 1},
                                                     "minItems": 1, "maxItems": 8},
                           "datatype": {"enum": list(DATATYPES)}, "parameters": _ref("Parameters"),
                           "data": {"type": "array", "description": "flat in row-major order, or nested as the "
                                    "shape; BYTES as strings (the image input: base64 of each file)"}}},
        "InferOutputRequest": {"type": "object", "required": ["name"], "additionalProperties": False,
                               "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 256},
                                              "parameters": _ref("Parameters")}},
        "InferRequest": {"type": "object", "required": ["inputs"], "additionalProperties": False, "properties": {
            "id": string, "parameters": _ref("Parameters"),
            "inputs": {"type": "array", "items": _ref("InferInput"), "minItems": 1},
            "outputs": {"type": "array", "items": _ref("InferOutputRequest")}},
            "description": "parameters: binary_data_output, threshold, max_detections, timeout (microseconds), "
                           "priority"},
        "InferOutput": {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
            "name": string, "datatype": string, "shape": {"type": "array", "items": integer},
            "parameters": _ref("Parameters"), "data": {"type": "array"}}},
        "InferResponse": {"type": "object", "required": ["model_name", "outputs"], "properties": {
            "model_name": string, "model_version": string, "id": string, "parameters": _ref("Parameters"),
            "outputs": {"type": "array", "items": _ref("InferOutput")}}},
        "RepositoryIndexEntry": {"type": "object", "required": ["name", "version", "state"], "properties": {
            "name": string, "version": string, "state": string, "reason": string}},
        "ModelVersionStatus": {"type": "object", "required": ["model_version_status"], "properties": {
            "model_version_status": {"type": "array", "items": {
                "type": "object", "required": ["version", "state", "status"], "properties": {
                    "version": string,
                    "state": {"enum": ["UNKNOWN", "START", "LOADING", "AVAILABLE", "UNLOADING", "END"]},
                    "status": {"type": "object", "required": ["error_code", "error_message"], "properties": {
                        "error_code": string, "error_message": string}}}}}}},
        "ModelMetadataV1": {"type": "object", "required": ["model_spec", "metadata"], "properties": {
            "model_spec": {"type": "object", "properties": {"name": string, "signature_name": string,
                                                            "version": nullable_string}},
            "metadata": {"type": "object", "required": ["signature_def"], "properties": {"signature_def": {
                "type": "object", "required": ["signature_def"], "properties": {"signature_def": {
                    "type": "object"}}}}}}},
        "PredictRequest": {"type": "object", "additionalProperties": False, "properties": {
            "signature_name": string,
            "instances": {"type": "array", "minItems": 1, "description": "the row form: one image per instance, "
                          "pixel values [height][width][3] or {\"b64\": \"<encoded image>\"}, bare or under the "
                          "input's name"},
            "inputs": {"type": ["array", "object"], "description": "the columnar form: a batch [N][height][width][3] or a list of "
                       "{\"b64\": ...}, bare or under the input's name"}},
            "oneOf": [{"required": ["instances"]}, {"required": ["inputs"]}]},
        "PredictResponse": {"type": "object", "properties": {
            "predictions": {"type": "array", "items": {"type": "object"}},
            "outputs": {"type": "object"}}},
    }


def document(model_names: list[str], version: str, title: str) -> dict:
    """The OpenAPI document for a server holding `model_names`."""
    name = _path_param("name", {"type": "string", "enum": list(model_names)}, "a model of this server")
    version_param = _path_param("version", {"type": "string"}, "the model version; only the one served is found")
    detect_errors = _errors("DetectError", DETECT_ERRORS)
    detect_errors["503"] = _retry(detect_errors["503"])
    v2_errors = _errors("ProtocolError", V2_ERRORS)
    v2_errors["503"] = _retry(v2_errors["503"])
    # Loopback clients only, unless restricted_api grants the group to a header (SECURITY.md).
    repository_errors = {**v2_errors, "403": _json(_ref("ProtocolError"), "not a loopback client, or the header "
                                                   "restricted_api requires is missing or wrong")}
    v1_errors = _errors("ProtocolError", V1_ERRORS)
    v1_errors["503"] = _retry(v1_errors["503"])
    binary = {"type": "string", "format": "binary"}
    content_encoding = {"name": "Content-Encoding", "in": "header", "schema": {"enum": ["gzip", "deflate", "identity"]},
                        "description": "the body's compression; it is inflated within max_body_bytes (default: identity)"}
    query = [
        {"name": "threshold", "in": "query", "schema": {"type": "number", "minimum": 0, "maximum": 1},
         "description": "score threshold (default: the default_threshold setting)"},
        {"name": "max_detections", "in": "query",
         "schema": {"type": "integer", "minimum": 1, "maximum": MAX_DETECTIONS_LIMIT},
         "description": f"the most detections to answer per image, highest scores first (default "
                        f"{DEFAULT_MAX_DETECTIONS}, at most {MAX_DETECTIONS_LIMIT})"},
        {"name": "timing", "in": "query", "schema": {"type": "string", "enum": ["stages"]},
         "description": "stages: timing_ms.stages breaks the time down by stage (the metrics reference lists them)"},
        {"name": "format", "in": "query", "schema": {"type": "string", "enum": ["json", "jpeg", "png"]},
         "description": "jpeg or png: answer the image with its boxes drawn (one image), the JSON answer in the "
                        "Detections header; default: what the Accept header prefers, else json"},
        {"name": "max_side", "in": "query", "schema": {"type": "integer", "minimum": 16, "maximum": MAX_SIDE_LIMIT},
         "description": "with a picture answer: its longest side at most this many pixels (default: the image's "
                        "own size)"},
    ]
    detect_body = {"required": True, "content": {
        **{kind: {"schema": binary} for kind in IMAGE_TYPES},
        "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
            "image": {"type": "array", "items": binary}}}},
        "application/json": {"schema": {"type": "object", "properties": {
            "image": {"type": "string", "description": "base64"},
            "images": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
            "oneOf": [{"required": ["image"]}, {"required": ["images"]}]}}}}
    answered = {"description": "labelled boxes in pixels; or, asked for (format, Accept), the image with its boxes "
                               "drawn, upright, in each class's colour",
                "headers": {"Detections": {"description": "with a picture answer: the JSON answer, up to 12 KiB "
                                                          "(beyond, the surest detections that fit and "
                                                          "detections_omitted)", "schema": {"type": "string"}}},
                "content": {"application/json": {"schema": _ref("DetectAnswer")},
                            "image/jpeg": {"schema": binary}, "image/png": {"schema": binary}}}
    detect = {"tags": ["detect"], "parameters": query, "requestBody": detect_body,
              "responses": {"200": answered, **detect_errors}}
    video_query = [
        query[0], query[1],
        {"name": "fps", "in": "query", "schema": {"type": "number", "exclusiveMinimum": 0},
         "description": "frames per second to sample, at most max_video_fps (default: every frame up to that rate)"},
        {"name": "format", "in": "query", "schema": {"type": "string", "enum": ["ndjson", "mp4"]},
         "description": "ndjson: a record per line; mp4: the video with its boxes and track ids drawn; default: what "
                        "the Accept header prefers (video/mp4), else ndjson"},
    ]
    video = {"tags": ["detect"], "parameters": video_query,
             "requestBody": {"required": True, "description": "the video file: MP4, MOV, MKV or WebM, up to "
                             "max_video_bytes", "content": {kind: {"schema": binary} for kind in VIDEO_TYPES}},
             "responses": {"200": {"description": "streamed as the frames come back: NDJSON records, or a fragmented "
                                                  "MP4 (H.264); every limit and bad video is refused before it starts",
                                   "content": {"application/x-ndjson": {"schema": _ref("VideoRecord")},
                                               "video/mp4": {"schema": binary}}}, **detect_errors}}
    def health(key: str, name: bool = False) -> dict:
        body = {"type": "object", "required": [key], "properties": {
            key: {"type": "boolean"}, **({"name": {"type": "string"}} if name else {})}}
        return {"200": _json(body, f"{key}: true"), "400": _json(body, f"{key}: false")}

    config = _json({"type": "object", "required": ["name", "platform", "max_batch_size", "input", "output"]},
                   "Triton's model configuration, in its JSON form")
    stats = _json({"type": "object", "required": ["model_stats"], "properties": {"model_stats": {"type": "array"}}},
                  "Triton's statistics extension: counts and nanoseconds per stage")

    def v2_get(summary: str, ok: dict, params: list, errors: bool = True) -> dict:
        responses = {"200": ok, **(v2_errors if errors else {})}
        return {"get": {"tags": ["v2"], "summary": summary, "parameters": params, "responses": responses}}

    infer_params = [
        {"name": HEADER_LENGTH, "in": "header", "schema": {"type": "integer", "minimum": 0},
         "description": "the JSON header's length; binary tensor data follows it (0: the body is one image file)"},
        content_encoding,
    ]
    infer = {"post": {
        "tags": ["v2"], "summary": "run the model (KServe v2, Triton's binary tensor data extension)",
        "parameters": infer_params,
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": _ref("InferRequest")},
            "application/octet-stream": {"schema": binary}}},
        "responses": {"200": {
            "description": "outputs; binary data after the JSON header when an output asked for it",
            "headers": {HEADER_LENGTH: {"schema": {"type": "integer"},
                                        "description": "present when binary data follows the JSON header"}},
            "content": {"application/json": {"schema": _ref("InferResponse")},
                        "application/octet-stream": {"schema": binary}}}, **v2_errors}}}
    predict = {"post": {
        "tags": ["v1"], "summary": "run the model (TF Serving predict: instances or inputs)",
        "parameters": [content_encoding],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("PredictRequest")}}},
        "responses": {"200": _json(_ref("PredictResponse"), "predictions (row form) or outputs (columnar)"),
                      **v1_errors}}}

    def v1_get(summary: str, schema: str, params: list) -> dict:
        return {"get": {"tags": ["v1"], "summary": summary, "parameters": params,
                        "responses": {"200": _json(_ref(schema), summary), **v1_errors}}}

    repository_body = {"content": {"application/json": {"schema": {"type": "object"}}}}
    paths = {
        "/detect": {"post": {**detect, "summary": "detect objects with the default model"}},
        "/models/{name}/detect": {"post": {**detect, "summary": "detect objects with a named model",
                                           "parameters": [name, *query]}},
        "/detect/video": {"post": {**video, "summary": "track objects through a video with the default model"}},
        "/models/{name}/detect/video": {"post": {**video, "summary": "track objects through a video with a named "
                                                 "model", "parameters": [name, *video_query]}},
        "/models": {"get": {"tags": ["models"], "summary": "every model: state, versions, worker, memory",
                            "responses": {"200": _json({"type": "object", "required": ["models", "spares"],
                                                        "properties": {
                                                            "models": {"type": "array", "items": _ref("Model")},
                                                            "spares": {"type": "array"},
                                                            "default_model": {"type": ["string", "null"]}}}, "the models"),
                                          **detect_errors}}},
        "/models/{name}": {"get": {"tags": ["models"], "summary": "one model", "parameters": [name],
                                   "responses": {"200": _json(_ref("Model"), "the model"), **detect_errors}}},
        "/healthz": {"get": {"tags": ["ops"], "summary": "liveness", "responses": {
            "200": _json({"type": "object", "properties": {"status": {"type": "string"}}}, "alive")}}},
        "/readyz": {"get": {"tags": ["ops"], "summary": "readiness", "responses": {
            "200": _json({"type": "object", "properties": {"status": {"type": "string"},
                                                           "models": {"type": "array"}}}, "ready"),
            "503": _json(_ref("DetectError"), "loading, a preloaded model failed, or shutting down")}}},
        "/gpu": {"get": {"tags": ["ops"], "summary": "GPU memory as NVML and TensorFlow see it",
                         "responses": {"200": _json({"type": "object"}, "the report")}}},
        "/gpu/history": {"get": {
            "tags": ["ops"], "summary": "the last minutes of memory per model, the HTTP process and the spares",
            "parameters": [{"name": "since", "in": "query", "required": False, "schema": {"type": "number"},
                            "description": "only the samples taken after this unix time (s)"}],
            "responses": {"200": _json({"type": "object", "required": ["interval_s", "keep_s", "now_unix", "series"],
                                        "properties": {"interval_s": {"type": "number"}, "keep_s": {"type": "number"},
                                                       "now_unix": {"type": "number"},
                                                       "fields": {"type": "array", "items": {"type": "string"}},
                                                       "series": {"type": "array"}}}, "the samples, by series"),
                          **detect_errors}}},
        "/": {"get": {"tags": ["page"], "summary": "the page: try a model, watch the memory", "responses": {
            "200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}}}},
        "/metrics": {"get": {"tags": ["ops"], "summary": "Prometheus metrics", "responses": {
            "200": {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"tags": ["ops"], "summary": "this document",
                                  "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")}}},
        "/v2": v2_get("server metadata", _json(_ref("ServerMetadata"), "name, version, extensions"), [],
                      errors=False),
        "/v2/health/live": v2_get("liveness", health("live")["200"], [], errors=False),
        "/v2/health/ready": {"get": {"tags": ["v2"], "summary": "readiness", "responses": health("ready")}},
        "/v2/models/{name}": v2_get("model metadata", _json(_ref("ModelMetadata"), "the signature"), [name]),
        "/v2/models/{name}/versions/{version}": v2_get(
            "model metadata", _json(_ref("ModelMetadata"), "the signature"), [name, version_param]),
        "/v2/models/{name}/ready": {"get": {"tags": ["v2"], "summary": "model readiness", "parameters": [name],
                                            "responses": {**v2_errors, **health("ready", name=True)}}},
        "/v2/models/{name}/versions/{version}/ready": {"get": {
            "tags": ["v2"], "summary": "model readiness", "parameters": [name, version_param],
            "responses": {**v2_errors, **health("ready", name=True)}}},
        "/v2/models/stats": v2_get("every model's statistics", stats, []),
        "/v2/models/{name}/stats": v2_get("the model's statistics", stats, [name]),
        "/v2/models/{name}/versions/{version}/stats": v2_get("the model's statistics", stats, [name, version_param]),
        "/v2/models/{name}/config": v2_get("model configuration", config, [name]),
        "/v2/models/{name}/versions/{version}/config": v2_get("model configuration", config, [name, version_param]),
        "/v2/models/{name}/infer": {"post": {**infer["post"], "parameters": [name, *infer_params]}},
        "/v2/models/{name}/versions/{version}/infer": {"post": {
            **infer["post"], "parameters": [name, version_param, *infer_params]}},
        "/v2/repository/index": {"post": {
            "tags": ["v2"], "summary": "Triton's model repository index", "requestBody": repository_body,
            "responses": {"200": _json({"type": "array", "items": _ref("RepositoryIndexEntry")}, "the models"),
                          **repository_errors}}},
        "/v2/repository/models/{name}/load": {"post": {
            "tags": ["v2"], "summary": "load a model and wait until it is ready", "parameters": [name],
            "requestBody": repository_body, "responses": {"200": _empty("loaded (empty body)"), **repository_errors}}},
        "/v2/repository/models/{name}/unload": {"post": {
            "tags": ["v2"], "summary": "unload a model; requests for it get 503 until it is loaded again",
            "parameters": [name], "requestBody": repository_body,
            "responses": {"200": _empty("unloaded (empty body)"), **repository_errors}}},
        "/v1/models/{name}": v1_get("model version status", "ModelVersionStatus", [name]),
        "/v1/models/{name}/versions/{version}": v1_get("model version status", "ModelVersionStatus",
                                                       [name, version_param]),
        "/v1/models/{name}/metadata": v1_get("signature_def map", "ModelMetadataV1", [name]),
        "/v1/models/{name}/versions/{version}/metadata": v1_get("signature_def map", "ModelMetadataV1",
                                                                [name, version_param]),
        "/v1/models/{name}:predict": {"post": {**predict["post"], "parameters": [
            name, *predict["post"]["parameters"]]}},
        "/v1/models/{name}/versions/{version}:predict": {"post": {**predict["post"], "parameters": [
            name, version_param, *predict["post"]["parameters"]]}},
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version,
                 "description": "Object detection over HTTP: this service's own /detect, KServe v2 (Open Inference "
                                "Protocol, with Triton's binary tensor data extension) and TF Serving's REST API."},
        "tags": [{"name": "detect"}, {"name": "models"}, {"name": "ops"}, {"name": "page"},
                 {"name": "v2", "description": "KServe v2 / Open Inference Protocol; errors {\"error\": \"...\"}"},
                 {"name": "v1", "description": "TF Serving REST API; errors {\"error\": \"...\"}"}],
        "paths": paths,
        "components": {"schemas": _schemas()},
    }
