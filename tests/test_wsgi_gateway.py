"""The service's WSGI gateway (app/hosting/wsgi.py) gives the app and the client what Twisted's own gives.

One WSGI app is served through Twisted's public WSGIResource and through the gateway (tests/wsgi_twins.py,
a real reactor on real sockets); every request is sent to both as the same raw bytes, and the environs the
app saw and the bytes that came back must match. The day a Twisted release changes what its gateway
does, these fail, and the gateway should follow.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def twins():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "wsgi_twins.py")], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        line = process.stdout.readline()
        assert line, process.stderr.read().decode(errors="replace")
        yield json.loads(line)
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
        process.stderr.close()


def exchange(port: int, raw: bytes) -> bytes:
    """Send `raw` and read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(raw)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    return received


def both(twins, raw: bytes) -> tuple[bytes, bytes]:
    """The answers of Twisted's gateway and ours to `raw`, each with its Date line blanked."""
    return tuple(re.sub(rb"\r\nDate: [^\r]*", b"\r\nDate: -", exchange(twins[side], raw))
                 for side in ("twisted", "ours"))


def request(method: str, path: str, body: bytes = b"", *headers: str) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: twins:8080", "Connection: close", *headers]
    if body:
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


@pytest.mark.parametrize("raw", [
    request("GET", "/whole"),
    request("HEAD", "/whole"),
    request("GET", "/no-type"),
    request("GET", "/stream"),
    request("GET", "/write"),
    request("GET", "/raise-before"),
    request("GET", "/raise-after"),
    request("GET", "/bytes-status"),
    request("GET", "/whole", b"", "Expect: 100-continue"),
], ids=["whole", "head", "no-content-type", "streamed", "write-callable", "app-raises-before-its-status",
        "app-raises-mid-answer", "status-not-str", "expect-continue"])
def test_the_client_gets_the_bytes_twisted_s_gateway_sends(twins, raw):
    theirs, ours = both(twins, raw)
    assert ours == theirs
    assert theirs  # an answer, or part of one, came back


def test_a_whole_answer_keeps_the_app_s_headers_but_not_its_server_and_date(twins):
    theirs, ours = both(twins, request("GET", "/whole"))
    head, _, body = ours.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 201 Created Here\r\n")
    assert b"Set-Cookie: a=1\r\nSet-Cookie: b=2" in head and b"X-Latin: caf\xe9" in head
    assert b"not-twisted" not in head and b"yesterday" not in head
    assert body == b"whole answer\n"


def test_headers_that_are_not_a_list_are_the_app_s_error_where_twisted_only_warns(twins):
    theirs, ours = both(twins, request("GET", "/headers-tuple"))
    assert theirs.startswith(b"HTTP/1.1 200 OK\r\n")
    assert ours.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")


def environ_seen(twins, side: str, raw: bytes) -> dict:
    answer = exchange(twins[side], raw)
    shown = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert shown.pop("SERVER_PORT") == str(twins[side])
    assert shown.pop("REMOTE_PORT").isdigit()
    return shown


@pytest.mark.parametrize("raw", [
    request("POST", "/environ?a=1&b=%C3%A9", b"first line\nsecond line\n", "Content-Type: text/plain",
            "X-Twice: one", "X-Twice: two", "X-Latin: caf\xe9"),
    request("POST", "/environ", b"", "Transfer-Encoding: chunked") + b"5\r\nab\ncd\r\n0\r\n\r\n",
    request("GET", "/environ"),
], ids=["content-length-body-and-headers", "chunked-body", "no-body"])
def test_the_app_sees_twisted_s_environ_and_when_the_body_began(twins, raw):
    theirs = environ_seen(twins, "twisted", raw)
    ours = environ_seen(twins, "ours", raw)
    assert theirs.pop("received") == "NoneType"
    assert ours.pop("received") == "float"  # the timeline's start (app/timeline.py)
    assert theirs.pop("cancellation") == "NoneType"
    assert ours.pop("cancellation") == "Cancellation"  # set if the client goes (app/cancellation.py)
    assert ours == theirs


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_stream_a_client_does_not_read_is_held_back_then_cut_where_twisted_buffers_it_whole(twins):
    """32 MiB streamed to a client that reads nothing: Twisted's gateway takes it all into the process's memory;
    ours waits while the socket is full, so the process holds no more than a socket's worth, and once the client
    has taken nothing for SEND_DEADLINE_S it cuts the connection (the answer's thread and memory come back)."""
    from app.protocol.admission import SEND_DEADLINE_S

    grown = {}
    for side in ("ours", "twisted"):
        before = rss_mib(twins["pid"])
        connection = socket.create_connection(("127.0.0.1", twins[side]), timeout=SEND_DEADLINE_S + 30)
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        connection.sendall(request("GET", "/big"))
        import time

        time.sleep(4)
        grown[side] = rss_mib(twins["pid"]) - before
        if side == "ours":
            time.sleep(SEND_DEADLINE_S + 2)
            received = b""
            try:
                while chunk := connection.recv(2**20):
                    received += chunk
            except ConnectionResetError:
                pass
            assert len(received) < 16 * 2**20, "the answer was not cut"
        connection.close()
    assert grown["twisted"] > 24, grown  # the whole answer, buffered: the test can see what it guards against
    assert grown["ours"] < 8, grown


def test_a_stream_read_slowly_but_steadily_arrives_whole(twins):
    import time

    with socket.create_connection(("127.0.0.1", twins["ours"]), timeout=30) as connection:
        connection.sendall(request("GET", "/big"))
        received = b""
        while chunk := connection.recv(2**20):
            received += chunk
            time.sleep(0.05)  # about 20 MiB/s at most: slower than the server writes
    body = received.partition(b"\r\n\r\n")[2]
    assert b"Transfer-Encoding: chunked" in received.partition(b"\r\n\r\n")[0]
    assert body.replace(b"\r\n", b"").count(b"x") == 32 * 2**20
