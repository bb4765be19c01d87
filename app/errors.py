"""The project's one error tree, and the table that maps it to HTTP.

DetectError
├── ConfigError              a setting has a value that is not allowed (boot, exit 2)
├── PolicyError              the GPU memory policy cannot be applied (boot, exit 2)
├── ModelError               the model folder is missing, empty or does not honour the contract (boot, exit 2)
│   └── WorkerNotStarted     no worker took the model in time, or none could start (not the model's fault)
├── NvmlUnavailable          NVML cannot be used: no driver, no library, or a failed call
├── MissingExtra             a command needs a package of an install extra that is not installed (exit 2)
├── WorkerLost               a model's worker process ended while a call was on it (retried, never sent)
├── AnswerCut                a streamed answer under way cannot be finished: the connection is closed
└── RequestError             something about one request; has an HTTP status
    ├── BadRequest           400
    │   ├── InvalidParameter     a query parameter is out of range or malformed
    │   ├── InvalidBody          JSON or base64 that does not parse, a missing field
    │   ├── InvalidImage         bytes that do not decode as an image
    │   ├── InvalidVideo         a body that is not a video taken, a truncated one, or a decoder that fails
    │   └── Unimplemented        a protocol extension or method this server does not implement (gRPC UNIMPLEMENTED)
    ├── NotFound             404
    │   ├── ModelNotFound        no model of that name in the repository
    │   └── VersionNotFound      the model does not serve that version
    ├── MethodNotAllowed     405
    ├── PayloadTooLarge      413
    │   ├── BodyTooLarge         the request body is over max_body_bytes
    │   ├── ImageTooLarge        the image header declares more than max_image_pixels
    │   └── VideoTooLarge        a video over max_video_bytes, max_video_s or max_video_frames
    ├── HeaderTooLarge       431: a request line or header line over Twisted's limit
    ├── UnsupportedMediaType 415
    │   ├── UnsupportedContentType   a Content-Type /detect does not take
    │   ├── UnsupportedContentEncoding  a Content-Encoding other than gzip, deflate or identity
    │   ├── UnsupportedImageFormat   an image format outside the decoder allowlist
    │   └── UnsupportedVideoFormat   a container or codec outside the video allowlist
    ├── InferenceFailed      500
    ├── InternalError        500: a bug; the cause is logged, never sent
    ├── LoadFailed           400: a load by request failed (the model folder is bad)
    ├── NotReady             503 with Retry-After: not loaded yet, or shutting down (then Connection: close)
    ├── Overloaded           503 with Retry-After: the inference queue is full
    ├── OutOfMemory          503: one image alone does not fit under the memory cap
    ├── ModelUnavailable     503 with Retry-After: the model's worker is down, given up, or unloaded by request
    ├── InsufficientGpuMemory 503 with Retry-After: loading the model would break the GPU budget
    ├── DeadlineExceeded     504: the answer did not come within request_deadline_s
    ├── CallIdle             408: a call held open (a stream, a Watch) moved no message for idle_timeout_s
    └── ClientGone           499: the client went away before its answer; its queued work was dropped
"""

from __future__ import annotations


class DetectError(Exception):
    """Base of every error this project raises on purpose."""

    code = "error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ConfigError(DetectError):
    """A setting has a value that is not allowed."""

    code = "invalid_setting"


class MissingExtra(DetectError):
    """A command needs a package of an install extra (tools, tls) that is not installed."""

    code = "missing_extra"


class PolicyError(DetectError):
    """The GPU memory policy cannot be applied."""

    code = "invalid_memory_policy"


class ModelError(DetectError):
    """The model folder is missing, empty, or does not honour the detection contract."""

    code = "invalid_model"


class WorkerNotStarted(ModelError):
    """No worker took the model in time (its start, or its load, outlasted the limit), or none could start:
    the host's trouble, not the model's, so the version is not marked as bad."""


class NvmlUnavailable(DetectError):
    """NVML cannot be used on this host."""

    code = "nvml_unavailable"


class WorkerLost(DetectError):
    """A model's worker process ended while a call was on it; the call may run again on its successor."""

    code = "worker_lost"


class AnswerCut(DetectError):
    """A streamed answer already under way (an annotated video) cannot be finished; the HTTP gateway closes the
    connection without its last chunk, so that the client sees the answer incomplete, not shorter and whole.
    `abort`: the client stopped reading, so the connection is dropped with what it holds, not flushed first."""

    code = "answer_cut"

    def __init__(self, message: str, abort: bool = False):
        super().__init__(message)
        self.abort = abort


class RequestError(DetectError):
    """Something about one request; HTTP_STATUS maps it to a status."""


class BadRequest(RequestError):
    """The request is malformed."""

    code = "bad_request"


class InvalidParameter(BadRequest):
    """A query parameter is out of range or malformed."""

    code = "invalid_parameter"


class Unimplemented(BadRequest):
    """A protocol extension or method this server does not implement: 400 over HTTP, as Triton answers a
    disabled extension's routes, and UNIMPLEMENTED over gRPC."""

    code = "not_implemented"


class InvalidBody(BadRequest):
    """The body does not parse, or lacks a required field."""

    code = "invalid_body"


class InvalidImage(BadRequest):
    """The bytes do not decode as an image."""

    code = "invalid_image"


class InvalidVideo(BadRequest):
    """The body is not a video this server takes (MP4, MOV, MKV, WebM), is truncated, or fails to decode."""

    code = "invalid_video"


class NotFound(RequestError):
    """No such route."""

    code = "not_found"


class ModelNotFound(NotFound):
    """No model of that name is in the repository."""

    code = "model_not_found"


class VersionNotFound(NotFound):
    """The model is in the repository, but the version asked for is not the one it serves."""

    code = "version_not_found"


class Forbidden(RequestError):
    """The route is restricted (restricted_api) or, for the model repository, open to loopback clients only."""

    code = "forbidden"


class MethodNotAllowed(RequestError):
    """The route exists but not for this method."""

    code = "method_not_allowed"


class PayloadTooLarge(RequestError):
    """The request or one image in it is over a size limit."""

    code = "payload_too_large"


class BodyTooLarge(PayloadTooLarge):
    """The request body is over max_body_bytes."""

    code = "body_too_large"


class ImageTooLarge(PayloadTooLarge):
    """The image header declares more pixels than max_image_pixels."""

    code = "image_too_large"


class VideoTooLarge(PayloadTooLarge):
    """A video is over max_video_bytes, longer than max_video_s, or has more frames than max_video_frames."""

    code = "video_too_large"


class HeaderTooLarge(RequestError):
    """A request line or one header line is over the limit."""

    code = "header_too_large"


class UnsupportedMediaType(RequestError):
    """The body's type is not one /detect takes."""

    code = "unsupported_media_type"


class UnsupportedContentType(UnsupportedMediaType):
    """A Content-Type that /detect does not take."""

    code = "unsupported_content_type"


class UnsupportedContentEncoding(UnsupportedMediaType):
    """A Content-Encoding other than gzip, deflate or identity."""

    code = "unsupported_content_encoding"


class UnsupportedImageFormat(UnsupportedMediaType):
    """An image format outside the decoder allowlist."""

    code = "unsupported_image_format"


class UnsupportedVideoFormat(UnsupportedMediaType):
    """A known format that is not a video taken here, or a video codec outside the decoder allowlist."""

    code = "unsupported_video_format"


class InferenceFailed(RequestError):
    """The model raised on this request's images."""

    code = "inference_failed"


class InternalError(RequestError):
    """Something failed that should not have; the cause is in the log."""

    code = "internal"


class LoadFailed(RequestError):
    """A load asked for by request failed: the model folder is missing, corrupt, or not the contract."""

    code = "load_failed"


class NotReady(RequestError):
    """The model is not loaded and warmed yet, or the server is shutting down."""

    code = "not_ready"
    retry_after_s = 1  # every 503 says when to come back: a restarted instance, or another behind the balancer


class Overloaded(RequestError):
    """The inference queue is full; the client should retry after a moment."""

    code = "overloaded"
    retry_after_s = 1


class OutOfMemory(RequestError):
    """The model ran out of memory on one image alone, under this instance's memory policy."""

    code = "out_of_memory"


class ModelUnavailable(RequestError):
    """The model cannot run now: its worker is restarting past the deadline, given up, or unloaded by request."""

    code = "model_unavailable"
    retry_after_s = 1


class InsufficientGpuMemory(RequestError):
    """Loading the model would break the GPU memory budget, and no idle model can make room."""

    code = "insufficient_gpu_memory"
    retry_after_s = 1


class DeadlineExceeded(RequestError):
    """The answer did not come within the request deadline."""

    code = "deadline_exceeded"


class CallIdle(RequestError):
    """A call held open (a gRPC stream, a health Watch) moved no message either way for idle_timeout_s: it is
    ended, so that an abandoned one gives its place back (gRPC UNAVAILABLE: open a new one)."""

    code = "idle"


class ClientGone(RequestError):
    """The client went away (its connection closed, its call was cancelled) before its answer: what it had
    queued was dropped before it reached the model. Nobody reads the answer; the code is for the logs and
    metrics (HTTP 499, as nginx records a client that closed its request; gRPC CANCELLED)."""

    code = "client_gone"


# Most specific class first wins: http_status() walks the MRO.
HTTP_STATUS: dict[type[RequestError], int] = {
    BadRequest: 400,
    Forbidden: 403,
    NotFound: 404,
    MethodNotAllowed: 405,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    HeaderTooLarge: 431,
    LoadFailed: 400,
    InferenceFailed: 500,
    InternalError: 500,
    NotReady: 503,
    ModelUnavailable: 503,
    InsufficientGpuMemory: 503,
    Overloaded: 503,
    OutOfMemory: 503,
    DeadlineExceeded: 504,
    CallIdle: 408,
    ClientGone: 499,
}


def request_errors() -> list[type[RequestError]]:
    """Every kind of request error, depth first: what each protocol's status table must cover."""

    def walk(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from walk(sub)

    return list(walk(RequestError))


def http_status(error: RequestError) -> int:
    """Return the HTTP status for a request error, from HTTP_STATUS."""
    for cls in type(error).__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return 500


# The gRPC services' one table (app/grpc), by grpc.StatusCode name, most specific class first as above.
# Bad input of any kind is INVALID_ARGUMENT, as Triton's and TF Serving's gRPC servers answer it; only the
# message itself over max_body_bytes is RESOURCE_EXHAUSTED (gRPC's own answer to an over-long message).
GRPC_STATUS: dict[type[RequestError], str] = {
    BadRequest: "INVALID_ARGUMENT",
    Forbidden: "PERMISSION_DENIED",
    NotFound: "NOT_FOUND",
    MethodNotAllowed: "UNIMPLEMENTED",
    Unimplemented: "UNIMPLEMENTED",
    BodyTooLarge: "RESOURCE_EXHAUSTED",
    PayloadTooLarge: "INVALID_ARGUMENT",
    HeaderTooLarge: "RESOURCE_EXHAUSTED",
    UnsupportedMediaType: "INVALID_ARGUMENT",
    LoadFailed: "INVALID_ARGUMENT",
    InferenceFailed: "INTERNAL",
    InternalError: "INTERNAL",
    NotReady: "UNAVAILABLE",
    ModelUnavailable: "UNAVAILABLE",
    InsufficientGpuMemory: "UNAVAILABLE",
    Overloaded: "RESOURCE_EXHAUSTED",
    OutOfMemory: "RESOURCE_EXHAUSTED",
    DeadlineExceeded: "DEADLINE_EXCEEDED",
    CallIdle: "UNAVAILABLE",
    ClientGone: "CANCELLED",
}


def grpc_status(error: RequestError) -> str:
    """Return the name of the grpc.StatusCode for a request error, from GRPC_STATUS."""
    for cls in type(error).__mro__:
        if cls in GRPC_STATUS:
            return GRPC_STATUS[cls]
    return "INTERNAL"
