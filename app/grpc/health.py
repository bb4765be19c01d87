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
(`Watches`) looks at every open Watch each WATCH_POLL_S and has a status sent when it has changed. The sends
run on a few threads of their own (WATCH_SENDERS), at most one per Watch at a time: gRPC's send waits until
the client has room, so a client that reads nothing must not hold the ticker, nor the probes' threads; the
interceptor cuts such a call once its send has waited SEND_DEADLINE_S (app/protocol/admission.py). The calls
are admitted and capped (max_watches) like every call held open.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
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
WATCH_SENDERS = 8
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
    last: Optional[int] = None  # the status sent last (or being sent)
    sending: bool = False


class Watches:
    """Every open Watch, the one thread that looks at their statuses, and the few that send them. Thread-safe."""

    def __init__(self, status: Callable[[str], Optional[int]]):
        self._status = status
        self._lock = threading.Lock()
        self._open: set[_Watch] = set()
        self._ticker: Optional[threading.Thread] = None
        self._senders = ThreadPoolExecutor(WATCH_SENDERS, thread_name_prefix="grpc-watch-send")
        self._stopped = threading.Event()

    def add(self, service: str, context, send: Callable[[object], None]) -> None:
        """Open a Watch: its status is sent at once (by a sender), and again on every change until its call ends."""
        watch = _Watch(service, context, send)
        with self._lock:
            if self._stopped.is_set():
                return
            self._open.add(watch)
            if self._ticker is None:
                self._ticker = threading.Thread(target=self._tick, name="grpc-health-watch", daemon=True)
                self._ticker.start()
        if not context.add_callback(lambda: self._forget(watch)):
            self._forget(watch)  # it ended before it was opened
            return
        self._look(watch)

    def count(self) -> int:
        with self._lock:
            return len(self._open)

    def end_all(self) -> None:
        """End every open Watch with UNAVAILABLE (at shutdown, so that the drain waits for none); no more ticks."""
        self._stopped.set()
        with self._lock:
            watches, self._open = list(self._open), set()
        for watch in watches:
            watch.context.set_code(grpc.StatusCode.UNAVAILABLE)
            watch.context.set_details("the server is shutting down; watch another instance")
            # The end is trailers, which flow control does not hold back, but a send may hold the call: cut it.
            if watch.sending:
                watch.context.cancel()
            else:
                self._senders.submit(self._deliver, watch, None)
        self._senders.shutdown(wait=False)

    def _forget(self, watch: _Watch) -> None:
        with self._lock:
            self._open.discard(watch)

    def _tick(self) -> None:
        while not self._stopped.wait(WATCH_POLL_S):
            with self._lock:
                watches = list(self._open)
            for watch in watches:
                try:
                    self._look(watch)
                except Exception:  # one call's trouble must not stop the others' ticks
                    log.exception("a health Watch could not be looked at")

    def _look(self, watch: _Watch) -> None:
        """Have the Watch's status sent if it changed and no send of it is under way (the ticker's thread)."""
        status = self._status(watch.service)
        status = SERVICE_UNKNOWN if status is None else status
        with self._lock:
            if watch.sending or status == watch.last or watch not in self._open:
                return
            watch.sending, watch.last = True, status
        try:
            self._senders.submit(self._deliver, watch, health_pb2.HealthCheckResponse(status=status))
        except RuntimeError:  # the senders have shut down: the server is stopping
            pass

    def _deliver(self, watch: _Watch, response) -> None:
        try:
            watch.send(response)
        except Exception:  # the call ended under the send
            log.debug("a Watch ended while its status was sent")
        finally:
            with self._lock:
                watch.sending = False
