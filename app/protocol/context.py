"""The request's context: who sent it, the model it names, its `Timeline` and its cancellation, whichever front
door took it.

Each front door opens a context when a request or call begins and closes it when it ends (app/http/app.py
in Flask's request hooks, app/grpc/calls.py in its interceptor); the data plane and the protocol logic
read and write it without knowing which door that was. It lives in a contextvars.ContextVar, so each
request thread sees its own, as MLServer keeps its request context (mlserver/context.py).

`client` is who sent it (its address and headers, as each door reads them), for the access rules the floor
applies itself (a shared-memory region named in an inference request); `cancellation` is set by the door when
the client goes away (app/cancellation.py).
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Mapping, Optional

from ..cancellation import Cancellation
from ..timeline import Timeline


@dataclass(frozen=True)
class Client:
    """Who sent a request: its address (None where there is none, a Unix socket) and its headers (gRPC: its
    metadata), keys lower-case."""

    address: Optional[str] = None
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass
class RequestContext:
    """One request's context: written only by the thread running the request."""

    timeline: Timeline = field(default_factory=Timeline)
    client: Client = field(default_factory=Client)
    cancellation: Cancellation = field(default_factory=Cancellation)
    model: str = ""  # the model the request named, for the request metrics ("" before one is named)
    ran: bool = False  # it reached its model (admitted to run images), so it counts in the model's statistics
    images: int = 0  # the images it ran


_current: ContextVar[Optional[RequestContext]] = ContextVar("detect_request", default=None)


def begin(timeline: Optional[Timeline] = None, client: Optional[Client] = None,
          cancellation: Optional[Cancellation] = None) -> Token:
    """Open a new context for the request starting in this thread; pass the token to `end`."""
    return _current.set(RequestContext(timeline if timeline is not None else Timeline(),
                                       client if client is not None else Client(),
                                       cancellation if cancellation is not None else Cancellation()))


def end(token: Token) -> None:
    """Close the context `begin` opened."""
    _current.reset(token)


def current() -> Optional[RequestContext]:
    """The context of the request running in this thread, or None outside one."""
    return _current.get()


def name_model(name: str) -> None:
    """Record the model the request names (the request metrics' label); no-op outside a request."""
    context = _current.get()
    if context is not None:
        context.model = name


def model_name() -> str:
    """The model the current request named, or ""."""
    context = _current.get()
    return context.model if context is not None else ""


def timeline() -> Optional[Timeline]:
    """The current request's timeline, or None outside a request."""
    context = _current.get()
    return context.timeline if context is not None else None
