"""Admission: the one rule a call meets before it may run, whichever front door it came in by.

Each door (the HTTP site, the gRPC server) has an `Admission` of its own, built from the same settings, and
asks it before a call runs; only this module decides, as KServe's and MLServer's data planes keep such a
rule in one place:

- while the server drains, nothing new is admitted (NotReady: HTTP 503, gRPC UNAVAILABLE);
- at most `http_threads` inference calls at once (a request that runs a model: one request thread each),
  and none while its model's queue is full (Overloaded: 503 with Retry-After, RESOURCE_EXHAUSTED), so
  overload is answered at once instead of piling calls up behind the queue;
- every call a client can hold open is of a HELD kind with a cap of its own (`caps`): a gRPC inference
  stream, a health Watch, a reflection stream; one over its cap is refused at once (Overloaded). This
  admission's watchdog thread ends what a client holds without using it:
  - a stream (inference or reflection) that moves no message either way for `idle_timeout_s`, and has no
    request with the model, is ended (`Ticket.on_idle`: UNAVAILABLE naming the setting);
  - a call whose client does not read: a send to it that has waited SEND_DEADLINE_S;
  - a call that an idle end did not end within END_GRACE_S (its thread stuck in a send, say) is cut
    (`Ticket.on_cut`: the call cancelled), and only a call's real end counts it out, so no place stays held
    by a call that is gone. A Watch is never idle: it hears from the server only when a status changes, and
    a healthy one may wait for hours (gRPC's keepalive finds a dead peer, app/grpc/server.py);
- probes (liveness and readiness: /healthz, /readyz, /v2/health/*, gRPC health Check, ServerLive,
  ServerReady, ModelReady) are never admitted here: they run on threads of their own that nothing
  admitted here can take (app/hosting/serve.py, app/grpc/server.py), so they answer whatever others hold.

The caps bound threads: each door sizes its pools from the same `caps` (an inference call or an open
stream holds one thread), which is why the counts are kept per door. Thread-safe: the HTTP site calls
`enter` in the reactor thread, gRPC in its worker threads.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol

from ..errors import NotReady, Overloaded

log = logging.getLogger(__name__)

INFERENCE = "inference"  # a request or call that runs a model
STREAM = "stream"  # a gRPC inference stream (ModelStreamInfer), held open by its client
WATCH = "watch"  # a gRPC health Watch, held open by its client
REFLECTION = "reflection"  # a gRPC server-reflection stream (grpcurl opens one per command)
HELD = (STREAM, WATCH, REFLECTION)
# A video through POST /detect/video: an inference request (it holds a WSGI thread) that lasts as long as its video,
# so it counts as VIDEO too, against a cap of its own: videos cannot take every thread from the images. Not HELD:
# it is never idle (each frame ends within request_deadline_s, or the stream ends with an error line).
VIDEO = "video"
# Reflection serves tools (grpcurl, Postman) that open a stream per command and close it; a handful is plenty.
REFLECTION_CAP = 8
WATCHDOG_MAX_TICK_S = 1.0
# A client with room to read takes a message at once; one whose send waited this long has stopped reading.
SEND_DEADLINE_S = 10.0
END_GRACE_S = 5.0  # after an idle end, how long a call may take to end before it is cut
IDLE_EXEMPT = (WATCH,)

_CAP_SETTINGS = {INFERENCE: "http_threads", STREAM: "max_streams", WATCH: "max_watches", VIDEO: "max_video_streams"}


class Lifecycle(Protocol):
    @property
    def draining(self) -> bool: ...


def caps_from(settings) -> dict[str, int]:
    """The cap of each kind of call, from the settings: what one door admits at once of each."""
    return {INFERENCE: settings.http_threads, STREAM: settings.max_streams, WATCH: settings.max_watches,
            REFLECTION: REFLECTION_CAP, VIDEO: settings.max_video_streams}


@dataclass(eq=False)
class Ticket:
    """One admitted call, until it leaves; for a held call, when it last moved a message and how it ends.

    The call's own threads write `on_idle`, `on_cut`, `busy`, `sending_since` and call `moved()`; the watchdog
    reads them. `busy` counts the call's work under way (a stream's requests in the model): a call is never idle
    while it has some. `on_idle()` ends the call gracefully and returns True, or returns False if it is busy
    again after all; `on_cut()` cancels it outright.
    """

    kind: str
    admission: "Admission" = field(repr=False)
    last_moved: float = field(default_factory=time.monotonic)
    busy: int = 0
    sending_since: Optional[float] = None  # a send to the client under way since then
    on_idle: Optional[Callable[[], bool]] = field(default=None, repr=False)
    on_cut: Optional[Callable[[], None]] = field(default=None, repr=False)
    ended_at: Optional[float] = None  # when an idle end was made
    cut: bool = False
    left: bool = False

    def moved(self) -> None:
        """A message went one way or the other: the call is not idle."""
        self.last_moved = time.monotonic()

    def sending(self, under_way: bool) -> None:
        """A send to the client begins (True) or has been taken (False)."""
        self.sending_since = time.monotonic() if under_way else None
        if not under_way:
            self.moved()

    def leave(self) -> None:
        self.admission.leave(self)


class Admission:
    """One door's admission: counts each kind of call against its cap; ends held calls left idle."""

    def __init__(self, door: str, settings, lifecycle: Optional[Lifecycle] = None,
                 on_idle_end: Optional[Callable[[str], None]] = None):
        self.door = door  # "http" or "grpc", for messages and metrics
        self.caps = caps_from(settings)
        self.idle_timeout_s = settings.idle_timeout_s
        self._lifecycle = lifecycle
        self._on_idle_end = on_idle_end  # called with the kind of each held call ended for idleness
        self._lock = threading.Lock()
        self._open = {kind: 0 for kind in self.caps}
        self._held: set[Ticket] = set()
        self._watchdog: Optional[threading.Thread] = None
        self._stopped = threading.Event()

    def enter(self, kind: str, model=None) -> Ticket:
        """Admit one call of `kind` (and, for an inference call, to `model`'s queue), or raise why not.

        NotReady while the server drains; Overloaded when `kind` is at its cap, or `model`'s queue is full.
        """
        with self._lock:
            if self._lifecycle is not None and self._lifecycle.draining:
                raise NotReady("the server is shutting down; retry on another instance")
            cap, open_now = self.caps[kind], self._open[kind]
            if open_now >= cap:
                raise Overloaded(_over_cap(kind, open_now, self.door))
            if model is not None:
                refusal = model.queue.refusal()
                if refusal is not None:
                    raise refusal
            self._open[kind] = open_now + 1
            ticket = Ticket(kind, self)
            if kind in HELD:
                self._held.add(ticket)
                self._start_watchdog()
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """Count a call out (once; a second leave does nothing)."""
        with self._lock:
            if ticket.left:
                return
            ticket.left = True
            self._open[ticket.kind] -= 1
            self._held.discard(ticket)

    @contextmanager
    def admitted(self, kind: str, model=None) -> Iterator[Ticket]:
        """Hold one admission of `kind` for the body of the with statement."""
        ticket = self.enter(kind, model)
        try:
            yield ticket
        finally:
            self.leave(ticket)

    def admit(self, model) -> AbstractContextManager[Ticket]:
        """Admit an inference call to `model` (the protocol logic's `admit` hook, app/protocol/v2.py and v1.py)."""
        return self.admitted(INFERENCE, model)

    def open_calls(self, kind: str) -> int:
        """How many calls of `kind` are admitted now."""
        with self._lock:
            return self._open[kind]

    # Idle held calls ------------------------------------------------------------------------------------

    def end_idle(self, now: Optional[float] = None) -> int:
        """End every held call idle for idle_timeout_s (its on_idle, outside the lock), cut those whose client
        has not read a send for SEND_DEADLINE_S or that an idle end did not end within END_GRACE_S; return how
        many were ended or cut."""
        now = time.monotonic() if now is None else now
        with self._lock:
            live = [t for t in self._held if not t.left and not t.cut]
            idle = [t for t in live if t.on_idle is not None and t.ended_at is None and t.kind not in IDLE_EXEMPT
                    and t.busy <= 0 and t.sending_since is None and now - t.last_moved >= self.idle_timeout_s]
            for ticket in idle:
                ticket.ended_at = now
            stuck = [t for t in live if t.on_cut is not None and (
                (t.sending_since is not None and now - t.sending_since >= SEND_DEADLINE_S)
                or (t.ended_at is not None and now - t.ended_at >= END_GRACE_S))]
            for ticket in stuck:
                ticket.cut = True
        ended = 0
        for ticket in idle:
            if self._end(ticket, now):
                ended += 1
        for ticket in stuck:
            log.info("%s %s call cut: %s", self.door, ticket.kind,
                     "its client has not read what it was sent" if ticket.ended_at is None
                     else "it did not end after its idle end")
            self._run(ticket.on_cut, ticket.kind)
        return ended + len(stuck)

    def _end(self, ticket: Ticket, now: float) -> bool:
        if not self._run(ticket.on_idle, ticket.kind):  # busy again after all: looked at again later
            with self._lock:
                ticket.ended_at = None
            return False
        log.info("%s %s call idle for %.0f s (idle_timeout_s): ended, its place given back once it has gone",
                 self.door, ticket.kind, now - ticket.last_moved)
        if self._on_idle_end is not None:
            self._on_idle_end(ticket.kind)
        return True

    @staticmethod
    def _run(callback: Callable, kind: str):
        try:
            return callback()
        except Exception:  # a held call's own ending must not stop the watchdog
            log.exception("ending a %s call failed", kind)
            return False

    def _start_watchdog(self) -> None:
        """Start the watchdog thread with the first held call (under the lock)."""
        if self._watchdog is None and not self._stopped.is_set():
            self._watchdog = threading.Thread(target=self._watch, name=f"{self.door}-idle-calls", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        tick = min(WATCHDOG_MAX_TICK_S, self.idle_timeout_s / 4)
        while not self._stopped.wait(tick):
            try:
                self.end_idle()
            except Exception:  # the watchdog must outlive any one bad tick
                log.exception("the idle-call watchdog failed a tick")

    def start(self) -> None:
        """Start the watchdog now, rather than with the first held call (the server's start: its threads then do
        not change with the traffic)."""
        with self._lock:
            self._start_watchdog()

    def stop(self) -> None:
        """Stop the watchdog (at shutdown)."""
        self._stopped.set()


def _over_cap(kind: str, open_now: int, door: str) -> str:
    """Why a call of `kind` is refused at its cap, naming the setting that sets it."""
    if kind == INFERENCE:
        calls = "gRPC inference calls" if door == "grpc" else "inference requests"
        return f"the server is handling {open_now} {calls}, its limit (http_threads); retry shortly"
    if kind == REFLECTION:
        return f"{open_now} reflection streams are open, the most this server holds ({REFLECTION_CAP}); retry shortly"
    noun = {STREAM: "inference streams", WATCH: "health Watch calls", VIDEO: "videos"}[kind]
    advice = "send on an open stream, or retry shortly" if kind == STREAM else "retry shortly"
    return f"{open_now} {noun} are open, the most this server holds ({_CAP_SETTINGS[kind]}); {advice}"
