"""Twisted's side of HTTP: a Site that limits bodies before buffering them, logs access, and drains.

Twisted buffers a whole request body before the WSGI app sees it, so the body limit is enforced
here, as the bytes arrive (Content-Length and chunked alike), and again by Flask.
Everything here runs in the reactor (I/O) thread.
"""

from __future__ import annotations

import json
import logging
import time

from twisted.internet import defer, reactor, task
from twisted.web import server

from .errors import error_body
from .settings import Settings

access_log = logging.getLogger("app.access")
log = logging.getLogger(__name__)


class DetectRequest(server.Request):
    """A request that refuses an over-limit body with 413 as soon as it is known to be over."""

    _rejected = False
    _received = 0
    _started = 0.0

    def gotLength(self, length):
        self._started = time.monotonic()
        limit = self.channel.site.settings.max_body_bytes
        if length is not None and length > limit:
            self._reject(f"the request body is {length} bytes, over the limit of {limit} bytes")
            return
        super().gotLength(length)

    def handleContentChunk(self, data):
        if self._rejected:
            return
        self._received += len(data)
        limit = self.channel.site.settings.max_body_bytes
        if self._received > limit:
            self._reject(f"the request body is over the limit of {limit} bytes")
            return
        super().handleContentChunk(data)

    def requestReceived(self, command, path, version):
        if self._rejected:
            return
        super().requestReceived(command, path, version)

    def process(self):
        site = self.channel.site
        site.in_flight += 1
        self.notifyFinish().addBoth(site.request_done)
        super().process()

    def _reject(self, message: str) -> None:
        """Answer 413 and close: the rest of the body is never read."""
        self._rejected = True
        self.requestHeaders.removeHeader(b"expect")  # no "100 Continue" after our answer
        body = json.dumps(error_body("body_too_large", message)).encode()
        transport = self.channel.transport
        transport.write(
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )
        transport.loseConnection()
        access_log.info("%s %s 413 (body over limit, refused while receiving)",
                        (self.method or b"-").decode("latin-1"), (self.uri or b"-").decode("latin-1"))


class DetectSite(server.Site):
    """The service's Site: idle timeout from the settings, request counting for a graceful drain."""

    requestFactory = DetectRequest

    def __init__(self, resource, settings: Settings):
        super().__init__(resource, timeout=settings.idle_timeout_s)
        self.settings = settings
        self.in_flight = 0
        self.displayTracebacks = False

    def request_done(self, result):
        self.in_flight -= 1
        return None  # swallow connection-lost failures: the client went away, nothing to log

    def log(self, request) -> None:
        """Write one access-log line: method, path, status, duration."""
        started = getattr(request, "_started", 0.0) or time.monotonic()
        access_log.info(
            "%s %s %s %.1fms",
            request.method.decode("latin-1"), request.uri.decode("latin-1", "replace")[:200],
            request.code, (time.monotonic() - started) * 1000,
        )

    def drain(self, port, grace_s: float) -> defer.Deferred:
        """Stop listening, then fire once no request is in flight, or after grace_s seconds."""
        stopped = defer.maybeDeferred(port.stopListening)
        deadline = time.monotonic() + grace_s
        done = defer.Deferred()

        def check():
            if self.in_flight <= 0 or time.monotonic() >= deadline:
                if self.in_flight > 0:
                    log.warning("shutdown grace of %.0f s is over with %d request(s) in flight", grace_s,
                                self.in_flight)
                loop.stop()

        loop = task.LoopingCall(check)
        loop.start(0.05, now=True).addCallback(lambda _: done.callback(None))
        return defer.gatherResults([stopped, done])
