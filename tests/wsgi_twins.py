"""Serve one test WSGI app twice, through Twisted's WSGIResource and through the service's gateway.

Prints {"twisted": port, "ours": port} on one line once both listen, then serves until killed. Each route
of the app exercises one path of a WSGI gateway; tests/test_wsgi_gateway.py sends the same bytes to both
ports and compares what comes back.
"""

from __future__ import annotations

import json
import os
import sys

from twisted.internet import reactor
from twisted.python.threadpool import ThreadPool
from twisted.web import server
from twisted.web.wsgi import WSGIResource

from app.cancellation import CANCELLATION_KEY
from app.hosting.wsgi import TimedWSGIResource, whole_body_input
from app.timeline import RECEIVED_KEY

LATIN = "caf\u00e9"  # a header value beyond ASCII, as WSGI's latin-1 native string


def environ_answer(environ, start_response):
    """Answer the environ's plain values and what wsgi.input reads, as JSON."""
    stream = environ["wsgi.input"]
    first_line = stream.readline(-1)
    rest = stream.read()
    environ["wsgi.errors"].write("a note to the error stream\n")
    shown = {k: (list(v) if isinstance(v, tuple) else v) for k, v in environ.items()
             if k not in ("wsgi.input", "wsgi.errors", RECEIVED_KEY, CANCELLATION_KEY)}
    shown["received"] = type(environ.get(RECEIVED_KEY)).__name__
    shown["cancellation"] = type(environ.get(CANCELLATION_KEY)).__name__
    shown["input"] = [first_line.decode("latin-1"), rest.decode("latin-1")]
    body = json.dumps(shown, sort_keys=True).encode()
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def whole(environ, start_response):
    """A whole answer with a Content-Length, repeated and latin-1 headers, and a Server and Date of its own."""
    body = b"whole answer\n"
    start_response("201 Created Here", [
        ("Content-Type", "text/plain"), ("Content-Length", str(len(body))), ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"), ("X-Latin", LATIN), ("Server", "not-twisted"), ("Date", "yesterday")])
    return [b"whole ", b"", b"answer\n"]


def no_type(environ, start_response):
    """An answer with no Content-Type: the gateway must not add one."""
    start_response("204 No Content", [])
    return []


def stream(environ, start_response):
    """Chunks with no Content-Length."""
    start_response("200 OK", [("Content-Type", "text/plain")])
    return iter([b"one ", b"", b"two ", b"three\n"])


BIG_CHUNKS = 32


def big_stream(environ, start_response):
    """32 MiB in chunks of 1 MiB, each a new one (as an encoder's are), with no Content-Length: what a client that
    reads slowly, or not at all, meets."""
    start_response("200 OK", [("Content-Type", "application/octet-stream")])
    return (b"x" * 2**20 for _ in range(BIG_CHUNKS))


def write_callable(environ, start_response):
    """The old-style write callable, then an empty iterable."""
    write = start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "12")])
    write(b"written ")
    return [b"out\n"]


def raise_before(environ, start_response):
    raise RuntimeError("the app fails before its status")


def raise_after(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    yield b"part of it"
    raise RuntimeError("the app fails mid-answer")


def bytes_status(environ, start_response):
    start_response(b"200 OK", [("Content-Length", "0")])
    return []


def headers_tuple(environ, start_response):
    start_response("200 OK", (("Content-Length", "0"),))
    return []


ROUTES = {"/environ": environ_answer, "/whole": whole, "/no-type": no_type, "/stream": stream, "/big": big_stream,
          "/write": write_callable, "/raise-before": raise_before, "/raise-after": raise_after,
          "/bytes-status": bytes_status, "/headers-tuple": headers_tuple}


def app(environ, start_response):
    return ROUTES[environ["PATH_INFO"]](environ, start_response)


def main() -> int:
    pool = ThreadPool(minthreads=1, maxthreads=4, name="twins")
    reactor.callWhenRunning(pool.start)
    reactor.addSystemEventTrigger("after", "shutdown", pool.stop)
    wrapped = whole_body_input(app)
    twisted_port = reactor.listenTCP(0, server.Site(WSGIResource(reactor, pool, wrapped)), interface="127.0.0.1")
    our_port = reactor.listenTCP(0, server.Site(TimedWSGIResource(reactor, pool, wrapped)), interface="127.0.0.1")
    print(json.dumps({"twisted": twisted_port.getHost().port, "ours": our_port.getHost().port, "pid": os.getpid()}),
          flush=True)
    reactor.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
