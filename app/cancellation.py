"""A request's cancellation: set once when the client that asked has gone away, so that its work stops.

The front door that took the request sets it: HTTP when the connection closes before the answer is written
(the reactor thread, app/hosting/wsgi.py), gRPC when the call ends before its handler does (gRPC's callback
thread, app/grpc/calls.py). Whoever holds work for the request registers what stops it with `on_cancel`: the
model's queue drops the request's images still waiting (app/inference/batcher.py), so work for a client
that has gone never reaches the model. Thread-safe; a callback runs once, in the thread that cancels, or at
once in the thread that registers it if the request was cancelled already.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)

CANCELLATION_KEY = "detect.cancellation"  # where an HTTP request's Cancellation is in its WSGI environ


class Cancellation:
    """Set once, when the request's client has gone; runs what was registered to stop its work."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cancelled = False
        self._callbacks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """The client has gone: run every registered callback (once; a second cancel does nothing)."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _run(callback)

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run `callback` when the request is cancelled (now, if it is already); return what unregisters it."""
        with self._lock:
            if not self._cancelled:
                self._callbacks.append(callback)
                return lambda: self._forget(callback)
        _run(callback)
        return lambda: None

    def _forget(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)


def _run(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:  # the door that cancels (the reactor, gRPC's thread) must not fail on a holder's bug
        log.exception("a cancellation callback failed")
