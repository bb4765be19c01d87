"""The one writer of error answers, for every protocol the server speaks and every layer that refuses.

Flask's handlers, the Twisted site's refusals (overload, shutdown, an over-long body or header line)
all answer through `error_answer`. Each protocol keeps its own body: this service's routes answer
`{"error": {"code", "message"}}`; the KServe v2 and TF Serving routes answer `{"error": "<message>"}`,
as their clients expect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from ..errors import RequestError, http_status
from .paths import DETECT


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
    """Write the answer to `error`: its status, JSON body, and Retry-After where it has one."""
    body = _html_safe(json.dumps(error_document(error, protocol), separators=(", ", ": "))).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
               ("X-Content-Type-Options", "nosniff")]
    retry_after = getattr(error, "retry_after_s", None)
    if retry_after is not None:
        headers.append(("Retry-After", str(retry_after)))
    headers.extend(extra_headers)
    return ErrorAnswer(http_status(error), tuple(headers), body)


def _html_safe(text: str) -> str:
    """Escape <, > and & as JSON \\u escapes: the same JSON, and a message that quotes a request's bytes can
    never be read as markup by a client that sniffs or renders it."""
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
