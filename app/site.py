"""Twisted's side of HTTP: a Site that limits bodies before buffering them, logs access, and drains.

Twisted buffers a whole request body before the WSGI app sees it, so the body limit is enforced
here, as the bytes arrive (Content-Length and chunked alike), and again by Flask.
Everything here runs in the reactor (I/O) thread.
"""

from __future__ import annotations

import inspect
import io
import json
import logging
import time
from typing import Callable, Optional

from twisted.internet import defer, task
from twisted.web import http, resource, server

from .errors import NotReady, Overloaded, RequestError, error_body, http_status
from .settings import Settings

access_log = logging.getLogger("app.access")
log = logging.getLogger(__name__)


def whole_body_input(app):
    """Wrap a WSGI app to tell it the input stream ends at the body's end.

    Twisted hands the app a fully buffered body, so reading to EOF is safe; without this flag
    Werkzeug reads nothing from a chunked body, which has no Content-Length.
    """

    def wrapped(environ, start_response):
        environ["wsgi.input_terminated"] = True
        return app(environ, start_response)

    return wrapped


CONTROL_PATHS = (b"healthz", b"readyz", b"metrics", b"gpu")
IN_MEMORY_BODY_BYTES = 4 * 2**20  # bodies up to this size are held in memory, not spooled to disk
DISCARD_ALLOWANCE = 64 * 2**20  # bytes past the limit read and dropped after a 413, before aborting


class ProbeFirstRoot(resource.Resource):
    """Send probes and metrics to their own WSGI thread pool, everything else to the main one.

    Both resources host the same Flask app; the split only keeps /readyz and /healthz from queueing
    behind inference when every main thread is busy.
    """

    def __init__(self, main: resource.Resource, control: resource.Resource):
        super().__init__()
        self._main = main
        self._control = control

    def getChildWithDefault(self, path, request):
        # Give the segment back, so the WSGI app sees the whole path, as it would at the root.
        request.postpath.insert(0, request.prepath.pop())
        return self._control if path in CONTROL_PATHS else self._main


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
        if length is not None and length <= IN_MEMORY_BODY_BYTES:
            # Twisted spools bodies from 100 kB to a temporary file: a disk write and read for every
            # photo. Photos stay in memory; larger and chunked bodies still spool.
            self.content = io.BytesIO()
            return
        super().gotLength(length)

    def handleContentChunk(self, data):
        self._received += len(data)
        limit = self.channel.site.settings.max_body_bytes
        if self._rejected:
            # Read and drop the rest, so a client still sending sees our 413 rather than a reset;
            # past the discard allowance, stop reading.
            if self._received > limit + DISCARD_ALLOWANCE:
                self.channel.transport.abortConnection()
            return
        if self._received > limit:
            self._reject(f"the request body is over the limit of {limit} bytes")
            return
        super().handleContentChunk(data)

    def requestReceived(self, command, path, version):
        if self._rejected:
            self.channel.transport.loseConnection()
            return
        super().requestReceived(command, path, version)

    def process(self):
        site = self.channel.site
        if self.path.split(b"?", 1)[0] == b"/detect":
            refusal = site.admit_detect()
            if refusal is not None:
                self.notifyFinish().addBoth(site.log_access, self)
                self._refuse(refusal)
                return
            self.notifyFinish().addBoth(site.detect_done)
        site.in_flight += 1
        # notifyFinish fires on finish or on a lost connection; Twisted's own log call runs only on
        # finish, which a client that has read its whole answer and hung up can beat.
        self.notifyFinish().addBoth(site.request_done, self)
        super().process()

    def _refuse(self, error: RequestError) -> None:
        """Answer `error` from the reactor, as the app's error handler would, without running the app."""
        body = json.dumps(error_body(error.code, error.message)).encode()
        self.setResponseCode(http_status(error))
        self.setHeader(b"content-type", b"application/json")
        retry_after_s = getattr(error, "retry_after_s", None)
        if retry_after_s is not None:
            self.setHeader(b"retry-after", str(retry_after_s).encode())
        else:  # shutting down: this connection has no future here
            self.setHeader(b"connection", b"close")
        self.write(body)
        self.finish()

    def _reject(self, message: str) -> None:
        """Answer 413 at once; the rest of the body is dropped unread, and the connection then closed."""
        self._rejected = True
        self.requestHeaders.removeHeader(b"expect")  # no "100 Continue" after our answer
        body = json.dumps(error_body("body_too_large", message)).encode()
        transport = self.channel.transport
        transport.write(
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )
        access_log.info("%s %s 413 (body over limit, refused while receiving)",
                        getattr(self.channel, "_command", b"-").decode("latin-1"),
                        getattr(self.channel, "_path", b"-").decode("latin-1", "replace")[:200])


class DetectChannel(http.HTTPChannel):
    """An HTTP connection with deadlines for a request's headers and for its body.

    The idle timeout restarts on every byte, so a client dripping headers (slowloris) or a body that
    stalls after a large Content-Length would hold the connection for ever; these deadlines do not.
    The header clock starts at a request's first byte, so idle keep-alive connections are not cut.
    """

    _header_timer = None
    _body_timer = None
    _awaiting_headers = True

    def dataReceived(self, data):
        if self._awaiting_headers and self._header_timer is None and data:
            self._header_timer = self.callLater(
                self.site.settings.header_timeout_s, self._deadline_passed, "request headers")
        super().dataReceived(data)

    def allHeadersReceived(self):
        self._awaiting_headers = False
        self._cancel("_header_timer")
        self._body_timer = self.callLater(self.site.settings.body_timeout_s, self._deadline_passed, "request body")
        super().allHeadersReceived()

    def allContentReceived(self):
        self._cancel("_body_timer")
        super().allContentReceived()

    def requestDone(self, request):
        self._awaiting_headers = True
        super().requestDone(request)

    def connectionLost(self, reason):
        self._cancel("_header_timer")
        self._cancel("_body_timer")
        super().connectionLost(reason)

    def lineLengthExceeded(self, line):
        """Answer 431 to a request line or header line over Twisted's 16 KiB, instead of a silent close."""
        body = json.dumps(error_body(
            "header_too_large", f"a request or header line is over the limit of {self.MAX_LENGTH} bytes")).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )
        self.transport.loseConnection()

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None and timer.active():
            timer.cancel()
        setattr(self, name, None)

    def _deadline_passed(self, what: str) -> None:
        setattr(self, "_header_timer" if what == "request headers" else "_body_timer", None)
        peer = self.transport.getPeer()
        log.info("closing the connection from %s: %s did not arrive in time", getattr(peer, "host", peer), what)
        self.transport.abortConnection()


class DetectSite(server.Site):
    """The service's Site: idle timeout from the settings, admission of /detect, counting for a graceful drain.

    At most `http_threads` /detect requests are admitted at once, one per WSGI thread, and none while
    the inference queue is full; the others get 503 with Retry-After at once, from the reactor.
    Without the first bound, requests beyond the threads would wait in Twisted's unbounded
    thread-pool queue, out of sight of the inference queue's bound and of their deadline, and
    overload would show as ever-growing latency instead of 503. Without the second, every request
    the queue will refuse would first take a thread and decode its image: under 4x overload that
    halved the throughput of the requests admitted.

    `queue_refusal` is called in the reactor for each /detect request; it returns the Overloaded
    error the inference queue would answer now, or None.
    """

    requestFactory = DetectRequest
    protocol = DetectChannel

    def __init__(self, resource, settings: Settings, on_refused: Optional[Callable[[int], None]] = None,
                 queue_refusal: Callable[[], Optional[Overloaded]] = lambda: None):
        options = {}
        if "parsePOSTFormSubmission" in inspect.signature(server.Site.__init__).parameters:
            # Twisted would parse multipart and urlencoded bodies itself, in the reactor thread (stalling
            # every connection on a body of many parts) and answer a malformed one with a bare 400.
            # Werkzeug parses them in a WSGI thread, with its part limits, and we answer in JSON.
            options["parsePOSTFormSubmission"] = False
        super().__init__(resource, timeout=settings.idle_timeout_s, **options)
        self.settings = settings
        self.in_flight = 0  # every request the app is handling, probes included
        self.detect_in_flight = 0
        self.draining = False
        self.displayTracebacks = False
        self._on_refused = on_refused  # called with the status of each /detect refused here
        self._queue_refusal = queue_refusal

    def admit_detect(self) -> Optional[RequestError]:
        """Count a /detect request in, or return the error that refuses it."""
        if self.draining:
            # Shutdown has begun: only requests accepted before it finish; probes still reach the app.
            refusal: Optional[RequestError] = NotReady("the server is shutting down; retry on another instance")
        elif self.detect_in_flight >= self.settings.http_threads:
            refusal = Overloaded(f"the server is handling {self.detect_in_flight} /detect requests, its limit "
                                 "(http_threads); retry shortly")
        else:
            refusal = self._queue_refusal()
        if refusal is None:
            self.detect_in_flight += 1
        elif self._on_refused is not None:
            self._on_refused(http_status(refusal))
        return refusal

    def detect_done(self, result) -> None:
        """Count an admitted /detect request out; swallows the client-went-away failure."""
        self.detect_in_flight -= 1

    def request_done(self, result, request) -> None:
        """Count a request out of flight and log it; swallows the client-went-away failure."""
        self.in_flight -= 1
        self.log_access(result, request)

    def log_access(self, result, request) -> None:
        """Write one access-log line: method, path, status, duration."""
        started = getattr(request, "_started", 0.0) or time.monotonic()
        # `result` is a Failure when the connection closed before finish(); with WSGI that is common
        # even for complete answers (the client reads Content-Length bytes and hangs up first).
        access_log.info(
            "%s %s %s %.1fms",
            request.method.decode("latin-1"), request.uri.decode("latin-1", "replace")[:200],
            request.code, (time.monotonic() - started) * 1000,
        )

    def log(self, request) -> None:
        """Twisted's access log hook; log_access replaces it."""

    def drain(self, port, grace_s: float) -> defer.Deferred:
        """Refuse new /detect work, wait until no request is in flight (at most grace_s), stop listening.

        The port stays open meanwhile, so probes see /readyz answer 503 rather than a refused connection.
        """
        self.draining = True
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
        done.addCallback(lambda _: port.stopListening())
        return done
