"""Twisted's side of HTTP: a Site that limits bodies before buffering them, logs access, and drains.

Twisted buffers a whole request body before the WSGI app sees it, so the body limit is enforced
here, as the bytes arrive (Content-Length and chunked alike), and again by Flask. The WSGI gateway the
Site routes to is app/hosting/wsgi.py. Everything here runs in the reactor (I/O) thread.
"""

from __future__ import annotations

import inspect
import io
import logging
import time
from typing import Callable, Optional
from urllib.parse import unquote_to_bytes

from twisted.internet import defer, task
from twisted.web import http, resource, server

from ..errors import BodyTooLarge, HeaderTooLarge, NotReady, RequestError, VideoTooLarge, http_status
from ..http.errors import ErrorAnswer, error_answer
from ..http.paths import VIDEO_ROUTES, Target, inference_target, is_video, protocol_of
from ..protocol.admission import INFERENCE, VIDEO, Admission
from ..settings import Settings
from ..timeline import TIMELINE_KEY, Timeline
from . import listening
from .lifecycle import PROBE_PATHS, PROBE_USER_AGENT

access_log = logging.getLogger("app.access")
log = logging.getLogger(__name__)


# The probes, answered on WSGI threads of their own that nothing else uses (app/protocol/admission.py), and the
# other control routes (metrics, /gpu), on theirs: neither waits behind inference, nor the probes behind a scrape.
PROBE_ROUTES = ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready")
CONTROL_ROUTES = ("/metrics", "/gpu")
IN_MEMORY_BODY_BYTES = 4 * 2**20  # bodies up to this size are held in memory, not spooled to disk
DISCARD_ALLOWANCE = 64 * 2**20  # bytes past the limit read and dropped after a 413, before aborting


class ProbeFirstRoot(resource.Resource):
    """Send probes to their own WSGI thread pool, metrics and /gpu to another, everything else to the main one.

    The resources host the same Flask app; the split only keeps the probes from queueing behind inference when
    every main thread is busy, or behind slow scrapes of /gpu.
    """

    def __init__(self, main: resource.Resource, control: resource.Resource, probes: resource.Resource):
        super().__init__()
        self._main = main
        self._control = control
        self._probes = probes

    def getChildWithDefault(self, path, request):
        # Give the segment back, so the WSGI app sees the whole path, as it would at the root.
        request.postpath.insert(0, request.prepath.pop())
        path = app_path(request)
        if path in PROBE_ROUTES:
            return self._probes
        return self._control if path in CONTROL_ROUTES else self._main


class DetectRequest(server.Request):
    """A request that refuses an over-limit body with 413 as soon as it is known to be over."""

    _rejected = False
    _received = 0
    _started = 0.0
    _limit = 0
    _video = False  # a video route: its body may be up to max_video_bytes

    def gotLength(self, length):
        self._started = time.monotonic()
        settings = self.channel.site.settings
        self._video = is_video(getattr(self.channel, "_path", b"").split(b"?", 1)[0].decode("latin-1", "replace"))
        self._limit = limit = settings.max_video_bytes if self._video else settings.max_body_bytes
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
        limit = self._limit
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
        path = app_path(self)
        target = inference_target(path)
        if target is not None:
            admitted = site.admit_inference(target)
            if isinstance(admitted, RequestError):
                self.notifyFinish().addBoth(site.log_access, self)
                self._refuse(admitted, protocol_of(path))
                return
            # Counted out when its WSGI job ends (app/hosting/wsgi.py), not when its connection does: a client that
            # hangs up does not free the thread its request still holds, nor a video the decoder it still runs.
            self.admission_tickets = admitted
        site.in_flight += 1
        # notifyFinish fires on finish or on a lost connection; Twisted's own log call runs only on
        # finish, which a client that has read its whole answer and hung up can beat.
        self.notifyFinish().addBoth(site.request_done, self)
        super().process()

    def _refuse(self, error: RequestError, protocol: str) -> None:
        """Answer `error` from the reactor, as the app's error handler would, without running the app."""
        answer = error_answer(error, protocol)
        self.setResponseCode(answer.status)
        for name, value in answer.headers:
            if name != "Content-Length":  # Twisted sets it from what is written
                self.setHeader(name.encode(), value.encode())
        if isinstance(error, NotReady):  # shutting down: this connection has no future here
            self.setHeader(b"connection", b"close")
        self.write(answer.body)
        self.finish()

    def _reject(self, message: str) -> None:
        """Answer 413 at once; the rest of the body is dropped unread, and the connection then closed."""
        self._rejected = True
        self.requestHeaders.removeHeader(b"expect")  # no "100 Continue" after our answer
        path = getattr(self.channel, "_path", b"").split(b"?", 1)[0].decode("latin-1", "replace")
        error = VideoTooLarge(f"{message} (max_video_bytes)") if self._video else BodyTooLarge(message)
        self.channel.transport.write(raw_answer(error_answer(error, protocol_of(path))))
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
    opened_at = 0.0
    requests_begun = 0

    def connectionMade(self):
        self.opened_at = time.monotonic()
        self.site.open_channels.add(self)
        super().connectionMade()

    def dataReceived(self, data):
        if self._awaiting_headers and self._header_timer is None and data:  # a request's first bytes
            self.requests_begun += 1
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
        self.site.open_channels.discard(self)
        self._cancel("_header_timer")
        self._cancel("_body_timer")
        super().connectionLost(reason)

    def holds_the_close(self, now: float) -> bool:
        """True while closing the server would cut this open connection short: a request of it is on its way
        (its headers' or its body's deadline running) or unanswered, its answer is still being written, or it
        is new (younger than header_timeout_s) and has sent nothing yet."""
        mid_request = self._header_timer is not None or not self._awaiting_headers
        if mid_request or getattr(self.transport, "disconnecting", False):
            return True
        return self.requests_begun == 0 and now - self.opened_at < self.site.settings.header_timeout_s

    def lineLengthExceeded(self, line):
        """Answer 431 to a request line or header line over Twisted's 16 KiB, instead of a silent close."""
        self.transport.write(raw_answer(error_answer(
            HeaderTooLarge(f"a request or header line is over the limit of {self.MAX_LENGTH} bytes"))))
        self.transport.loseConnection()

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None and timer.active():
            timer.cancel()
        setattr(self, name, None)

    def _deadline_passed(self, what: str) -> None:
        setattr(self, "_header_timer" if what == "request headers" else "_body_timer", None)
        peer = self.transport.getPeer()
        log.info("closing the connection from %s:%s: %s did not arrive in time",
                 getattr(peer, "host", peer), getattr(peer, "port", "-"), what)
        self.transport.abortConnection()


def app_path(request) -> str:
    """A request's path as the app routes it: each segment unquoted, as Twisted builds postpath and the WSGI
    gateway PATH_INFO, so that admission sees /%64etect as the /detect the app will run."""
    raw = request.path.split(b"?", 1)[0]
    return b"/".join(unquote_to_bytes(segment) for segment in raw.split(b"/")).decode("latin-1")


def raw_answer(answer: ErrorAnswer) -> bytes:
    """Write an error answer as raw HTTP/1.1 bytes that close the connection (for refusals before a Request)."""
    head = [f"HTTP/1.1 {answer.status} {http.RESPONSES.get(answer.status, b'Error').decode()}"]
    head += [f"{name}: {value}" for name, value in answer.headers]
    head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + answer.body


class DetectSite(server.Site):
    """The service's Site: idle timeout from the settings, admission of inference, counting for a graceful drain.

    Each inference request is admitted by the one rule (app/protocol/admission.py) in the reactor, before it
    takes a WSGI thread: at most `http_threads` at once, one per WSGI thread, and none while their model's
    inference queue is full, nor once the server drains; the others get 503 with Retry-After at once. Without
    the first bound, requests beyond the threads would wait in Twisted's unbounded thread-pool queue, out of
    sight of the inference queue's bound and of their deadline, and overload would show as ever-growing latency
    instead of 503. Without the second, every request the queue will refuse would first take a thread and
    decode its image: under 4x overload that halved the throughput of the requests admitted.

    `find_model(target)` is called in the reactor for each inference request, with the model it names
    (DEFAULT_MODEL for /detect); it returns the model, or None where there is none (the app answers 404).
    """

    requestFactory = DetectRequest
    protocol = DetectChannel

    def __init__(self, resource, settings: Settings, lifecycle, admission: Admission,
                 on_refused: Optional[Callable[[str, int, str], None]] = None,
                 find_model: Callable[[str], object] = lambda target: None,
                 on_stages: Optional[Callable[[str, Timeline], None]] = None):
        options = {}
        if "parsePOSTFormSubmission" in inspect.signature(server.Site.__init__).parameters:
            # Twisted would parse multipart and urlencoded bodies itself, in the reactor thread (stalling
            # every connection on a body of many parts) and answer a malformed one with a bare 400.
            # Werkzeug parses them in a WSGI thread, with its part limits, and we answer in JSON.
            options["parsePOSTFormSubmission"] = False
        super().__init__(resource, timeout=settings.idle_timeout_s, **options)
        self.settings = settings
        self.lifecycle = lifecycle
        self.in_flight = 0  # every request the app is handling, probes included
        self.admission = admission
        self.displayTracebacks = False
        self._on_refused = on_refused  # called with (route, status, model) of each request refused here
        self._find_model = find_model
        self._on_stages = on_stages  # called with (model, timeline) of each request that ran images
        self.open_channels: set = set()  # every connection of this Site not yet lost

    @property
    def inference_in_flight(self) -> int:
        return self.admission.open_calls(INFERENCE)

    def admit_inference(self, target: Target):
        """Admit an inference request: its admission's Tickets, to leave when it is done (a video's as an inference
        request, which holds a WSGI thread, and as a video, against max_video_streams), or the error that refuses
        it. While the server drains, only requests accepted before finish; probes still reach the app."""
        kinds = [INFERENCE, VIDEO] if target.route in VIDEO_ROUTES else [INFERENCE]
        tickets = []
        try:
            for kind in kinds:
                tickets.append(self.admission.enter(kind, self._find_model(target.model) if kind == INFERENCE
                                                    else None))
        except RequestError as refusal:
            for ticket in tickets:
                ticket.leave()
            if self._on_refused is not None:
                self._on_refused(target.route, http_status(refusal), target.model)
            return refusal
        return tickets

    def request_done(self, result, request) -> None:
        """Count a request out of flight, record its stages and log it; swallows the client-went-away failure."""
        self.in_flight -= 1
        ran = getattr(request, "wsgi_environ", {}).get(TIMELINE_KEY)
        if ran is not None and self._on_stages is not None:
            model, timeline = ran
            timeline.lap("write")
            self._on_stages(model, timeline)
        self.log_access(result, request)

    def log_access(self, result, request) -> None:
        """Write one access-log line: method, path, status, duration; none for the fleet's readiness probe."""
        if request.path in PROBE_PATHS and request.getHeader(b"user-agent") == PROBE_USER_AGENT.encode():
            return
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
        """Wait until no request is in flight (at most grace_s), then close the port without resets.

        The lifecycle is draining already, so new inference requests are refused. The port stays open
        meanwhile, so probes see /readyz answer 503 rather than a refused connection. Once nothing is
        in flight the port is sealed (app/hosting/listening.py): no new connection completes; the
        reactor accepts what the kernel had queued, and the port closes once that queue is empty and no
        connection holds the close (DetectChannel.holds_the_close: a request on its way or unanswered,
        or a new connection that has not spoken yet), all within the grace. So neither the close nor the
        reactor's stop after it cuts a request short. With a grace of 0, or where the port cannot be
        sealed, it closes at once, as before.
        """
        deadline = time.monotonic() + grace_s
        done = defer.Deferred()
        sealed: Optional[bool] = None  # None: not tried yet

        def check():
            nonlocal sealed
            now = time.monotonic()
            if now < deadline:
                if self.in_flight > 0:
                    return
                if sealed is None:
                    sealed = self._seal(port)
                if sealed and self._held_open(port, now):
                    return
            if self.in_flight > 0:
                log.warning("shutdown grace of %.0f s is over with %d request(s) in flight", grace_s, self.in_flight)
            loop.stop()

        loop = task.LoopingCall(check)
        loop.start(0.05, now=True).addCallback(lambda _: done.callback(None))
        done.addCallback(lambda _: self._close(port))
        return done

    def _seal(self, port) -> bool:
        listener = getattr(port, "socket", None)
        if listener is None or not listening.seal(listener):
            return False
        log.info("port sealed: no new connection completes; %s queued by the kernel and %d open to answer "
                 "before it closes", listening.queued(listener), len(self.open_channels))
        return True

    def _held_open(self, port, now: float) -> bool:
        """True while the kernel still queues a connection, or an open one holds the close."""
        if listening.queued(port.socket):
            return True
        return any(channel.holds_the_close(now) for channel in self.open_channels)

    def _close(self, port):
        listener = getattr(port, "socket", None)
        left = listening.queued(listener) if listener is not None else None
        if left:
            log.warning("closing the port resets %d connection(s) the kernel had queued", left)
        return port.stopListening()
