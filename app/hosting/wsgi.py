"""The service's WSGI gateway: the Flask app in a thread pool, a whole answer handed to the I/O thread at once.

Twisted's WSGIResource hands each chunk of an answer to the I/O thread with blockingCallFromThread (the
request thread waits for the I/O thread to write it, then wakes) and then the finish with another call:
three thread wake-ups per answer, each a quarter of a millisecond on an idle virtual CPU
(docs/concepts/latency.md). Here an answer with a Content-Length (every answer this app builds, errors
included) is gathered and handed over once, with its finish, and the request thread does not wait.
Streamed answers (no Content-Length, or over WHOLE_ANSWER_BYTES) keep Twisted's way, chunk by chunk, with flow
control Twisted's gateway lacks: the request thread waits while the client's socket is full (the gateway is the
answer's push producer, paused and resumed by the transport), so a client that reads slowly makes the server hold
at most a socket buffer of it, not the whole answer; one that has taken nothing for SEND_DEADLINE_S is cut off,
as the gRPC port cuts a call whose client stops reading (app/protocol/admission.py).

Changing that needs the object that drives one request, which Twisted keeps private
(twisted.web.wsgi._WSGIResponse, no compatibility promise) and which this service used to subclass. This
gateway is built on Twisted's public API only (Resource, Request, ThreadPool.callInThread,
reactor.callFromThread, threads.blockingCallFromThread, Logger), so any Twisted release that keeps that
API serves it, and twisted's version is not pinned. What the app and the client see is Twisted's own,
byte for byte: the same environ, the same status line and headers (Server and Date stay Twisted's, no
default Content-Type), the same 500 when the app raises; tests/test_wsgi_gateway.py serves one app
through both gateways and compares the environs and the bytes on the wire. Two corners are stricter, said
where they are: start_response's header types, and wsgi.errors' text with braces. It does what the
subclass did per request, call for call, so it is as fast (tools/ab.py on /detect found no difference
beyond this machine's noise).
"""

from __future__ import annotations

import sys
import threading
import time

from twisted.internet import interfaces, threads
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http, resource, server
from zope.interface import implementer

from ..cancellation import CANCELLATION_KEY, Cancellation
from ..errors import AnswerCut
from ..protocol.admission import SEND_DEADLINE_S
from ..timeline import RECEIVED_KEY

WHOLE_ANSWER_BYTES = 16 * 2**20  # an answer with a Content-Length up to this size goes out in one hand-off


def whole_body_input(app):
    """Wrap a WSGI app to tell it the input stream ends at the body's end.

    Twisted hands the app a fully buffered body, so reading to EOF is safe; without this flag
    Werkzeug reads nothing from a chunked body, which has no Content-Length.
    """

    def wrapped(environ, start_response):
        environ["wsgi.input_terminated"] = True
        return app(environ, start_response)

    return wrapped


class TimedWSGIResource(resource.Resource):
    """Host a WSGI app at this resource and below, telling the app when its request's body began.

    That mark starts the request's timeline (app/timeline.py); the environ is kept on the request
    (`request.wsgi_environ`), so that the I/O thread can add the `write` stage when the answer has gone out.
    """

    isLeaf = True  # every path below belongs to the app

    def __init__(self, reactor, threadpool, application):
        super().__init__()
        self._reactor = reactor
        self._threadpool = threadpool
        self._application = application

    def render(self, request):
        answer = WholeAnswer(self._reactor, self._application, request)
        answer.environ[RECEIVED_KEY] = getattr(request, "_started", 0.0) or time.monotonic()
        request.wsgi_environ = answer.environ
        self._threadpool.callInThread(answer.run)
        return server.NOT_DONE_YET


class WholeAnswer:
    """Run the app for one request in a WSGI thread and write its answer through the I/O thread.

    Built in the I/O thread; `run` and the WSGI callables run in a WSGI thread, and hand every touch of
    the request to the I/O thread with callFromThread. `started` (status and headers sent) belongs to the
    WSGI thread; `finished` (the request is finished or its connection lost) is set in the I/O thread.
    """

    _log = Logger()

    def __init__(self, reactor, application, request):
        self.reactor = reactor
        self.application = application
        self.request = request
        self.started = False
        self.finished = False
        self.status: str = ""
        self.headers: list = []
        self.environ = wsgi_environ(request)
        # Set when the client goes away before its answer, so that what it queued is dropped (app/cancellation.py).
        self.environ[CANCELLATION_KEY] = Cancellation()
        self.flow = Flow()
        request.notifyFinish().addBoth(self._finish_noted)
        request.defaultContentType = None  # the app decides every header

    def _finish_noted(self, result) -> None:
        self.finished = True
        self.flow.resumeProducing()  # a thread waiting for room stops waiting: there is no one to write to
        if isinstance(result, Failure):  # the connection was lost before the answer was written: the client went
            self.environ[CANCELLATION_KEY].cancel()

    def start_response(self, status, headers, exc_info=None):
        """The WSGI start_response: keep the status and headers until the answer goes out (PEP 3333).

        Stricter than Twisted's, which lets any sequence pass with a RuntimeWarning: headers must be a list of
        (str, str) tuples, as PEP 3333 says and Werkzeug always gives.
        """
        if self.started and exc_info is not None:
            raise exc_info[1].with_traceback(exc_info[2])
        if not isinstance(status, str):
            raise TypeError(f"status must be str, not {status!r} ({type(status).__name__})")
        if not isinstance(headers, list):
            raise TypeError(f"headers must be a list, not {headers!r} ({type(headers).__name__})")
        for header in headers:
            if not (isinstance(header, tuple) and len(header) == 2 and all(isinstance(e, str) for e in header)):
                raise TypeError(f"header must be a (str, str) tuple, not {header!r}")
        self.status = status
        self.headers = headers
        return self.write

    def write(self, data: bytes) -> None:
        """The WSGI write callable: send one chunk (the status and headers first), waiting until it is written
        and until the client has room for more; raise AnswerCut if it has taken nothing for SEND_DEADLINE_S."""

        def write_in_io_thread(started):
            if not started:
                self._send_headers()
                self.request.registerProducer(self.flow, True)
            self.request.write(data)

        if not self.flow.wait(SEND_DEADLINE_S, lambda: self.finished):
            raise AnswerCut(f"the client took nothing of the answer for {SEND_DEADLINE_S:g} s", abort=True)
        try:
            threads.blockingCallFromThread(self.reactor, write_in_io_thread, self.started)
        finally:
            self.started = True

    def run(self) -> None:
        """In a WSGI thread: call the app, then hand its whole answer, or its failure, to the I/O thread.

        A request whose client went away while it waited for this thread is not run at all. An inference request
        is counted out of its admission (the site's tickets) when this ends, not when its connection does: until
        then it holds this thread."""
        try:
            if self.environ[CANCELLATION_KEY].cancelled:
                return
            self._run_app()
        finally:
            for ticket in getattr(self.request, "admission_tickets", ()):
                ticket.leave()

    def _run_app(self) -> None:
        try:
            answer = self.application(self.environ, self.start_response)
            try:
                length = next((v for k, v in self.headers if k.lower() == "content-length"), None)
                if length is None or not length.isdigit() or int(length) > WHOLE_ANSWER_BYTES:
                    self._stream(answer)
                    return
                body = b"".join(answer)
            finally:
                close = getattr(answer, "close", None)
                if close is not None:
                    close()
        except AnswerCut as cut:  # a stream that cannot be finished: cut it, so the client sees it incomplete
            self._log.info("a streamed answer was cut short: {why}", why=cut.message)
            self.reactor.callFromThread(self._cut, cut.abort)
        except BaseException:
            self.reactor.callFromThread(self._failed, self.started, *sys.exc_info())
        else:
            self.reactor.callFromThread(self._send_whole, self.started, body)
        self.started = True

    def _stream(self, answer) -> None:
        for chunk in answer:
            if chunk:
                self.write(chunk)
            if self.finished:
                break
        self.reactor.callFromThread(self._send_whole, self.started, b"")

    def _send_headers(self) -> None:
        """In the I/O thread: set the status and the app's headers (all but Server and Date, which are Twisted's)."""
        code, message = self.status.split(None, 1)
        self.request.setResponseCode(int(code), message.encode("iso-8859-1"))
        for name, value in self.headers:
            if name.lower() not in ("server", "date"):
                self.request.responseHeaders.addRawHeader(name.encode("iso-8859-1"), value.encode("iso-8859-1"))

    def _send_whole(self, started: bool, body: bytes) -> None:
        """In the I/O thread: the status and headers unless `started` (sent already), the body, then the finish."""
        if self.finished:
            return
        if not started:
            self._send_headers()
        if body:
            self.request.write(body)
        if self.request.producer is not None:
            self.request.unregisterProducer()
        self.request.finish()

    def _cut(self, abort: bool = False) -> None:
        """In the I/O thread: close the connection of an answer under way, without its last chunk; `abort` drops
        what it still holds (its client reads nothing, so a close that waited to flush it would never come)."""
        if self.finished:
            return
        if abort:
            self.request.channel.transport.abortConnection()
        else:
            self.request.loseConnection()

    def _failed(self, started, kind, value, traceback) -> None:
        """In the I/O thread: log the app's exception (it never should raise: it answers every error), answer 500."""
        self._log.failure("WSGI application error", failure=Failure(value, kind, traceback))
        if started:
            self.request.loseConnection()
        else:
            self.request.setResponseCode(http.INTERNAL_SERVER_ERROR)
            self.request.finish()


def wsgi_environ(request) -> dict:
    """Build the WSGI environ of `request` (in the I/O thread), as Twisted's WSGIResource does."""
    script_name = b"/" + b"/".join(request.prepath) if request.prepath else b""
    path_info = b"/" + b"/".join(request.postpath) if request.postpath else b""
    query = request.uri.split(b"?", 1)[1] if b"?" in request.uri else b""
    peer = request.getClientAddress()
    environ = {
        "REQUEST_METHOD": _native(request.method),
        "REMOTE_ADDR": _native(peer.host),
        "REMOTE_PORT": _native(str(peer.port)),
        "SCRIPT_NAME": _native(script_name),
        "PATH_INFO": _native(path_info),
        "QUERY_STRING": _native(query),
        "CONTENT_TYPE": _native(request.getHeader(b"content-type") or ""),
        "CONTENT_LENGTH": _native(request.getHeader(b"content-length") or ""),
        "SERVER_NAME": _native(request.getRequestHostname()),
        "SERVER_PORT": _native(str(request.getHost().port)),
        "SERVER_PROTOCOL": _native(request.clientproto),
    }
    for name, values in request.requestHeaders.getAllRawHeaders():
        # A header's newlines would break the environ's one-line values; Twisted blanks them too.
        environ["HTTP_" + _native(name).upper().replace("-", "_")] = ",".join(_native(v) for v in values).replace(
            "\n", " ")
    environ.update({
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "https" if request.isSecure() else "http",
        "wsgi.run_once": False,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.errors": ErrorStream(),
        # The I/O thread has finished writing the body; from here only the WSGI thread reads it.
        "wsgi.input": InputStream(request.content),
    })
    return environ


def _native(value: str | bytes) -> str:
    """A WSGI native string: bytes as ISO-8859-1 characters (PEP 3333)."""
    if isinstance(value, str):
        return value.encode("iso-8859-1").decode("iso-8859-1")
    return value.decode("iso-8859-1")


@implementer(interfaces.IPushProducer)
class Flow:
    """A streamed answer's push producer: the transport pauses it when the client's socket is full and resumes
    it when there is room (the I/O thread); the request thread waits on it before each chunk."""

    def __init__(self):
        self._room = threading.Event()
        self._room.set()

    def pauseProducing(self) -> None:
        self._room.clear()

    def resumeProducing(self) -> None:
        self._room.set()

    def stopProducing(self) -> None:
        self._room.set()

    def wait(self, timeout_s: float, over) -> bool:
        """Wait until there is room (True), the answer is over (`over()`, True), or `timeout_s` has passed (False)."""
        deadline = time.monotonic() + timeout_s
        while not self._room.wait(0.5):
            if over():
                return True
            if time.monotonic() >= deadline:
                return False
        return True


class InputStream:
    """The app's `wsgi.input`: the request's buffered body, read in a WSGI thread (PEP 3333's four methods)."""

    def __init__(self, content):
        self._content = content

    def read(self, size=None):
        return self._content.read() if size is None else self._content.read(size)

    def readline(self, size=None):
        return self._content.readline() if size is None or size == -1 else self._content.readline(size)

    def readlines(self, hint=None):
        return self._content.readlines() if hint is None else self._content.readlines(hint)

    def __iter__(self):
        return iter(self._content)

    # Beyond PEP 3333: the body is whole (in memory, or spooled to a temporary file by Twisted), so a route that
    # needs to seek in it (a video's demuxer) reads it in place rather than copying it.
    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._content.seek(offset, whence)

    def tell(self) -> int:
        return self._content.tell()


class ErrorStream:
    """The app's `wsgi.errors`: each write is an error event in Twisted's log, from the system `wsgi`."""

    _log = Logger()

    def write(self, data: str) -> None:
        if not isinstance(data, str):
            raise TypeError(f"write() argument must be str, not {data!r} ({type(data).__name__})")
        # The text is a field, not the format, so a brace in it does not garble the line (Twisted's own uses
        # it as the format); without braces the logged line is the same.
        self._log.error("{text}", text=data, system="wsgi", isError=True)

    def writelines(self, lines) -> None:
        self.write("".join(lines))

    def flush(self) -> None:
        """Nothing is buffered (PEP 3333 still asks for the method)."""
