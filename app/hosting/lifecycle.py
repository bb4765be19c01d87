"""Where the server is in its life, kept in one place: starting, serving, draining, stopped.

The site's admission, /readyz and the shutdown sequence all ask this object; only the composition
root moves it on. It also tells a supervising process (the fleet) what happened, as JSON lines on the
`notify_fd` descriptor: {"event": "listening", "host", "port", "grpc_port" (where gRPC is on)}, {"event": "ready"}, {"event": "draining"}.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Optional

log = logging.getLogger(__name__)

PHASES = ("starting", "serving", "draining", "stopped")
# The reactor beats every HEARTBEAT_S; a server whose reactor has not beaten for STALE_AFTER_S answers no HTTP
# request, so its liveness (gRPC health's "liveness", which Kubernetes' grpc probe asks) turns NOT_SERVING.
HEARTBEAT_S = 1.0
STALE_AFTER_S = 5.0

# The User-Agent of the fleet's readiness probe (every 200 ms while an instance starts): the access log leaves
# those requests out, and a user's own /readyz, with any other agent, is logged as any request.
PROBE_USER_AGENT = "gpu-share-detect-fleet-probe"
PROBE_PATHS = (b"/readyz",)


class Lifecycle:
    """The server's phase; thread-safe. Phases only move forward."""

    def __init__(self, notify_fd: int = -1):
        self._lock = threading.Lock()
        self._phase = "starting"
        self._notify_fd = notify_fd
        self._beat = time.monotonic()

    def beat(self) -> None:
        """The reactor is turning: called from it every HEARTBEAT_S (app/hosting/serve.py)."""
        self._beat = time.monotonic()

    @property
    def responsive(self) -> bool:
        """Whether the reactor has beaten within STALE_AFTER_S: a stuck reactor answers no HTTP request at all."""
        return time.monotonic() - self._beat < STALE_AFTER_S

    @property
    def phase(self) -> str:
        with self._lock:
            return self._phase

    @property
    def draining(self) -> bool:
        """True from the start of shutdown on: no new work, /readyz 503."""
        return self.phase in ("draining", "stopped")

    def _advance(self, phase: str) -> bool:
        with self._lock:
            if PHASES.index(phase) <= PHASES.index(self._phase):
                return False
            self._phase = phase
        self.notify({"event": phase if phase != "serving" else "ready"})
        return True

    def listening(self, host: str, port: int, grpc_port: Optional[int] = None) -> None:
        """The port is bound (and the gRPC port, where there is one)."""
        event = {"event": "listening", "host": host, "port": port}
        if grpc_port is not None:
            event["grpc_port"] = grpc_port
        self.notify(event)

    def serving(self) -> bool:
        """Every preloaded model is ready; return False if that was already said."""
        return self._advance("serving")

    def begin_draining(self) -> bool:
        """Shutdown has begun; return False if it had already."""
        return self._advance("draining")

    def stopped(self) -> None:
        self._advance("stopped")

    def notify(self, event: dict) -> None:
        """Write one event line to the notify descriptor, if there is one; a reader gone away is ignored."""
        if self._notify_fd < 0:
            return
        try:
            os.write(self._notify_fd, (json.dumps(event) + "\n").encode())
        except OSError as exc:
            log.debug("notify descriptor %d: %s", self._notify_fd, exc)


class Notifications:
    """The reading end of a server's notify descriptor, for whoever starts servers (the fleet, tests, benchmarks).

    Give `child_fd` to the server (pass_fds, and DETECT_NOTIFY_FD), then call `started()` to close this
    process's copy of it; `poll()` returns every event so far without blocking.
    """

    def __init__(self):
        self._read, self.child_fd = os.pipe()
        os.set_blocking(self._read, False)
        self._buffer = b""
        self.events: list[dict] = []

    def started(self) -> None:
        """Close this side's copy of the write end (the server has its own)."""
        if self.child_fd >= 0:
            os.close(self.child_fd)
            self.child_fd = -1

    def poll(self) -> list[dict]:
        """Read what has arrived; return every event so far."""
        while self._read >= 0:
            try:
                data = os.read(self._read, 4096)
            except BlockingIOError:
                break
            if not data:
                break
            self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                self.events.append(json.loads(line))
            except ValueError:
                log.debug("not an event: %r", line[:200])
        return self.events

    def find(self, name: str) -> Optional[dict]:
        """Return the latest event of that name so far, or None."""
        return next((e for e in reversed(self.poll()) if e.get("event") == name), None)

    def close(self) -> None:
        self.started()
        if self._read >= 0:
            os.close(self._read)
            self._read = -1
