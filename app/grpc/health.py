"""`grpc.health.v1.Health`: the server's readiness and each model's, for Kubernetes' `grpc:` probes and grpc-health-probe.

The name "liveness" is SERVING while the server answers at all, as /healthz would (a Kubernetes liveness probe's
service): while the Twisted reactor, which every HTTP request passes, still beats (app/hosting/lifecycle.py).
A stuck reactor turns it NOT_SERVING within STALE_AFTER_S, so the probe fails and the pod is restarted, though
the gRPC threads still answer. The service "" (the whole server) and the name of each gRPC service on the port are SERVING while /readyz
would answer 200: every preloaded model loaded, shutdown not begun. A model's name is SERVING while it can
answer: loaded, or unloaded only for idleness (its next call loads it); NOT_SERVING while it loads, has
failed or was unloaded by request. Any other name is NOT_FOUND, as the health protocol asks.

Check runs on the probes' own threads (app/grpc/calls.py). Watch holds no thread while it waits: it is gRPC's
non-blocking form (the handler returns at once and answers through a callback), and one ticker thread
(`Watches`) looks at every open Watch each WATCH_POLL_S and sends a status when it has changed. The calls
themselves are admitted, capped (max_watches) and ended when idle by the interceptor, like every call held open.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..errors import NotFound
from ..protocol.plane import DataPlane

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
WATCH_POLL_S = 1.0
LIVENESS = "liveness"  # SERVING while the reactor beats, as /healthz would answer


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Answer Check from the live state of the server and its models, and Watch from the ticker; called in gRPC
    worker threads."""

    def __init__(self, plane: DataPlane, service_names: tuple[str, ...]):
        self._plane = plane
        self._names = ("", *service_names)
        self.watches = Watches(self.status)

    def status(self, name: str):
        """The status of `name` (the server, a gRPC service, or a model); None for a name that is none of those."""
        if name == LIVENESS:
            return SERVING if self._plane.alive() else NOT_SERVING
        if name in self._names:
            return SERVING if self._plane.ready() else NOT_SERVING
        model = self._plane.find_model(name)
        if model is None:
            return None
        if model.state == "ready" or (model.state == "unloaded" and not model.unloaded_by_request):
            return SERVING
        return NOT_SERVING

    def Check(self, request, context):
        status = self.status(request.service)
        if status is None:
            raise NotFound(f"no service or model named {request.service[:100]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request, context, send_response_callback=None):
        """Send the status now and on every change (looked at each WATCH_POLL_S), until the call ends; an unknown
        name is SERVICE_UNKNOWN, and the call goes on, as the health protocol asks."""
        self.watches.add(request.service, context, send_response_callback)

    Watch.experimental_non_blocking = True  # gRPC passes send_response_callback and frees the thread at once


@dataclass(eq=False)
class _Watch:
    service: str
    context: object = field(repr=False)
    send: Callable[[object], None] = field(repr=False)
    last: Optional[int] = None


class Watches:
    """Every open Watch, and the one thread that sends each its status when it changes. Thread-safe."""

    def __init__(self, status: Callable[[str], Optional[int]]):
        self._status = status
        self._lock = threading.Lock()
        self._open: set[_Watch] = set()
        self._ticker: Optional[threading.Thread] = None
        self._stopped = threading.Event()

    def add(self, service: str, context, send: Callable[[object], None]) -> None:
        """Open a Watch: send its status now; it is looked at on every tick until its call ends."""
        watch = _Watch(service, context, send)
        context.add_callback(lambda: self._forget(watch))
        self._send_if_changed(watch)
        with self._lock:
            if self._stopped.is_set():
                return
            self._open.add(watch)
            if self._ticker is None:
                self._ticker = threading.Thread(target=self._tick, name="grpc-health-watch", daemon=True)
                self._ticker.start()

    def count(self) -> int:
        with self._lock:
            return len(self._open)

    def end_all(self) -> None:
        """End every open Watch with UNAVAILABLE (at shutdown, so that the drain waits for none); no more ticks."""
        self._stopped.set()
        with self._lock:
            watches, self._open = list(self._open), set()
        for watch in watches:
            try:
                watch.context.set_code(grpc.StatusCode.UNAVAILABLE)
                watch.context.set_details("the server is shutting down; watch another instance")
                watch.send(None)
            except Exception:  # its call is ending anyway
                log.debug("a Watch had ended already")

    def _forget(self, watch: _Watch) -> None:
        with self._lock:
            self._open.discard(watch)

    def _tick(self) -> None:
        while not self._stopped.wait(WATCH_POLL_S):
            with self._lock:
                watches = list(self._open)
            for watch in watches:
                try:
                    self._send_if_changed(watch)
                except Exception:  # one call's trouble must not stop the others' ticks
                    log.exception("a health Watch could not be sent its status")

    def _send_if_changed(self, watch: _Watch) -> None:
        status = self._status(watch.service)
        status = SERVICE_UNKNOWN if status is None else status
        if status != watch.last:
            watch.last = status
            watch.send(health_pb2.HealthCheckResponse(status=status))
