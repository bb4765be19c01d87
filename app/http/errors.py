"""The one writer of error answers, for every protocol the server speaks and every layer that refuses.

Flask's handlers, the Twisted site's refusals (overload, shutdown, an over-long body or header line)
all answer through `error_answer`. Each protocol keeps its own body: this service's routes answer
`{"error": {"code", "message"}}`; the KServe v2 and TF Serving routes answer `{"error": "<message>"}`,
as their clients expect. Each protocol also has its status table: this service's own is
app.errors.HTTP_STATUS; v2 and v1 override the few entries where Triton's or TF Serving's codes differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from ..errors import DeadlineExceeded, OutOfMemory, RequestError, UnsupportedMediaType, http_status
from .headers import SECURITY_HEADERS
from .paths import DETECT, V1, V2

# Where Triton's HTTP server answers differently: it refuses every malformed request with 400, and a
# request whose timeout expired with 503 (UNAVAILABLE), as it does when its queue is full.
V2_STATUS: dict[type[RequestError], int] = {
    UnsupportedMediaType: 400,
    DeadlineExceeded: 503,
}
# Where TF Serving answers differently (its ToHTTPStatusCode): malformed input is INVALID_ARGUMENT (400), and
# a model call out of memory is RESOURCE_EXHAUSTED (429).
V1_STATUS: dict[type[RequestError], int] = {
    UnsupportedMediaType: 400,
    OutOfMemory: 429,
}
_OVERRIDES = {V2: V2_STATUS, V1: V1_STATUS}


def status_of(error: RequestError, protocol: str = DETECT) -> int:
    """Return the HTTP status of `error` in the protocol's own table (the most specific class wins)."""
    overrides = _OVERRIDES.get(protocol, {})
    for cls in type(error).__mro__:
        if cls in overrides:
            return overrides[cls]
        if cls is RequestError:
            break
    return http_status(error)


def error_document(error: RequestError, protocol: str = DETECT) -> dict:
    """Return the JSON body of an error answer in the protocol's own shape."""
    if protocol == DETECT:
        return {"error": {"code": error.code, "message": error.message}}
    return {"error": error.message}


@dataclass(frozen=True)
class ErrorAnswer:
    """A whole error answer: status, headers, body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def error_answer(error: RequestError, protocol: str = DETECT,
                 extra_headers: Sequence[tuple[str, str]] = ()) -> ErrorAnswer:
    """Write the answer to `error`: its status, JSON body, the security headers, and Retry-After where it has one."""
    body = _html_safe(json.dumps(error_document(error, protocol), separators=(", ", ": "))).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
               *SECURITY_HEADERS]
    status = status_of(error, protocol)
    retry_after = getattr(error, "retry_after_s", None)
    if retry_after is None and status == 503:
        retry_after = 1  # every 503 says when to come back (Triton's timeout is a 503 too, in KServe v2)
    if retry_after is not None:
        headers.append(("Retry-After", str(retry_after)))
    headers.extend(extra_headers)
    return ErrorAnswer(status, tuple(headers), body)


def _html_safe(text: str) -> str:
    """Escape <, > and & as JSON \\u escapes: the same JSON, and a message that quotes a request's bytes can
    never be read as markup by a client that sniffs or renders it."""
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
