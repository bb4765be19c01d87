"""Boot and shutdown of the real server: readiness, SIGTERM with requests in flight, bad models."""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import gauge as _gauge, in_flight as _in_flight, start_server, wait_for
from images_for_tests import encode


def _queue_depth(server, model: str = "slowblob") -> int:
    return _gauge(server, f'detect_queue_depth{{model="{model}"}}')


def test_detect_requests_beyond_http_threads_get_503_at_once_and_the_admitted_finish(blob_model_dir, tmp_path):
    server = start_server({"DETECT_MODEL": str(blob_model_dir), "DETECT_HTTP_THREADS": "2"}, tmp_path / "log")
    big = encode(np.full((1500, 1500, 3), 90, np.uint8), "PNG")  # seconds of decoding and model per request
    answers: list = []
    start = threading.Barrier(12)

    def send():
        start.wait()
        sent = time.monotonic()
        status, headers, body = server.request("POST", "/detect", big, {"Content-Type": "image/png"})
        answers.append((status, headers, body, time.monotonic() - sent))

    senders = [threading.Thread(target=send) for _ in range(12)]
    for thread in senders:
        thread.start()
    time.sleep(0.5)
    status, _, _ = server.request("GET", "/readyz", timeout=2)  # probes have threads of their own
    assert status == 200
    for thread in senders:
        thread.join(120)
    served = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] == 503]
    assert len(served) + len(refused) == 12 and len(served) >= 2 and len(refused) >= 1, [a[0] for a in answers]
    for _, headers, body, seconds in refused:
        assert headers["Retry-After"] == "1" and body["error"]["code"] == "overloaded"
        assert "http_threads" in body["error"]["message"]
        assert seconds < min(s for *_, s in served)  # refused at once, not after queueing
    metrics = server.request("GET", "/metrics")[2].decode()
    counted = re.search(r'^detect_http_requests_total\{model="blob",route="/detect",status="503"\} (\S+)$', metrics, re.M)
    assert counted and float(counted.group(1)) == len(refused)
    assert server.stop() == 0 and "Traceback" not in server.log()


def test_while_the_inference_queue_is_full_detect_gets_503_before_its_body_is_decoded(slow_blob_model_dir, tmp_path):
    server = start_server({"DETECT_MODEL": str(slow_blob_model_dir), "DETECT_MAX_QUEUE": "1",
                           "DETECT_MAX_BATCH_SIZE": "1", "DETECT_INFERENCE_THREADS": "1"}, tmp_path / "log")
    image = encode(np.full((64, 64, 3), 90, np.uint8), "PNG")
    statuses: list = []
    senders = [threading.Thread(target=lambda: statuses.append(
        server.request("POST", "/detect", image, {"Content-Type": "image/png"})[0])) for _ in range(2)]
    # The first runs in the model (a second or more); then the second waits, and the queue is full.
    senders[0].start()
    waited = time.monotonic() + 30
    while _in_flight(server) < 1 and time.monotonic() < waited:
        time.sleep(0.02)
    time.sleep(0.3)  # decoding 64x64 pixels and handing them over takes milliseconds
    senders[1].start()
    while _queue_depth(server) < 1 and time.monotonic() < waited:
        time.sleep(0.02)
    assert _queue_depth(server) == 1 and not statuses
    # Not an image: a request that reached a decoder would get 400, so this 503 came before decoding.
    status, headers, body = server.request("POST", "/detect", b"not an image", {"Content-Type": "image/png"})
    assert status == 503 and headers["Retry-After"] == "1" and body["error"]["code"] == "overloaded"
    assert "inference queue is full" in body["error"]["message"]
    for thread in senders:
        thread.join(60)
    assert statuses == [200, 200]
    status, _, body = server.request("POST", "/detect", b"not an image", {"Content-Type": "image/png"})
    assert status == 400 and body["error"]["code"] == "invalid_image"
    assert server.stop() == 0 and "Traceback" not in server.log()


def test_sigterm_turns_readiness_503_finishes_requests_in_flight_then_exits_0(slow_blob_model_dir, tmp_path):
    # The first request's model call takes a second or more; the other 49 arrive meanwhile and wait in the
    # inference queue for the next call, which takes them all.
    server = start_server({"DETECT_MODEL": str(slow_blob_model_dir), "DETECT_HTTP_THREADS": "64",
                           "DETECT_MAX_BATCH_SIZE": "64", "DETECT_MAX_BATCH_DELAY_MS": "0",
                           "DETECT_INFERENCE_THREADS": "1"}, tmp_path / "log")
    image = encode(np.full((64, 64, 3), 90, np.uint8), "PNG")
    results: list = []

    def send():
        try:
            results.append(server.request("POST", "/detect", image, {"Content-Type": "image/png"})[0])
        except OSError as exc:
            results.append(exc)

    senders = [threading.Thread(target=send) for _ in range(50)]
    for thread in senders:
        thread.start()
    waited = time.monotonic() + 30  # until all 50 are admitted
    in_flight = 0
    while in_flight < 50 and time.monotonic() < waited:
        time.sleep(0.02)
        in_flight = _in_flight(server)
    assert in_flight == 50 and not results, (in_flight, results)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    status, _, ready = server.request("GET", "/readyz")
    assert status == 503 and "shutting down" in ready["error"]["message"]
    assert time.monotonic() - started < 1.0
    status, headers, refused = server.request("POST", "/detect", image, {"Content-Type": "image/png"})
    assert status == 503 and refused["error"]["code"] == "not_ready" and headers["Retry-After"] == "1"
    for thread in senders:
        thread.join(60)
    status = server.process.wait(30)
    log = server.log()
    assert status == 0, log
    assert results == [200] * 50, log
    assert time.monotonic() - started < 20
    # All requests in flight, counted at SIGTERM, are the 50 /detect requests and, at times, the
    # test's last /metrics poll, whose answer the client has read before the reactor counts it out.
    drained = re.search(r"shutting down: not ready, refusing new work, (\d+) request\(s\) in flight \((\d+) inference\)",
                        log)
    assert drained and drained.group(2) == "50" and drained.group(1) in ("50", "51"), log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_requests_still_running_after_the_grace_are_abandoned_and_the_process_exits(slow_blob_model_dir, tmp_path):
    # Each model call takes a second or more, so requests are still running when the grace of 0 s ends.
    server = start_server({"DETECT_MODEL": str(slow_blob_model_dir), "DETECT_HTTP_THREADS": "32",
                           "DETECT_SHUTDOWN_GRACE_S": "0"}, tmp_path / "log")
    image = encode(np.full((64, 64, 3), 90, np.uint8), "PNG")
    senders = [threading.Thread(target=lambda: _quietly(server, image)) for _ in range(20)]
    for thread in senders:
        thread.start()
    waited = time.monotonic() + 30
    while _in_flight(server) < 20 and time.monotonic() < waited:
        time.sleep(0.02)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0
    assert "abandoning" in server.log()
    for thread in senders:
        thread.join(30)


def test_a_burst_of_connections_while_the_server_cannot_accept_is_queued_and_every_one_answered(blob_model_dir, tmp_path):
    """The kernel queues what the reactor has not accepted yet: with Twisted's backlog of 50 the chaos soak's
    bursts of 160 image requests, landing while the reactor was busy, had some connections reset after a second
    (here 33 of 300)."""
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())  # the kernel's cap on any backlog
    if somaxconn < 128:
        pytest.skip(f"net.core.somaxconn is {somaxconn}: a backlog over Twisted's 50 cannot be shown here")
    burst = min(300, somaxconn - 8)
    server = start_server({"DETECT_MODEL": str(blob_model_dir)}, tmp_path / "log")
    image = encode(np.random.default_rng(26).integers(0, 255, (160, 160, 3), np.uint8), "JPEG")  # about 40 KB
    answers: list = []

    def detect():
        try:
            answers.append(server.request("POST", "/detect", image, {"Content-Type": "image/jpeg"}, timeout=60)[0])
        except OSError as exc:
            answers.append(repr(exc))

    try:
        server.process.send_signal(signal.SIGSTOP)  # the reactor accepts nothing while the connections arrive
        try:
            clients = [threading.Thread(target=detect) for _ in range(burst)]
            for thread in clients:
                thread.start()
            time.sleep(3.0)  # past the kernel's first retransmission (1 s), where the backlog's overflow showed
        finally:
            server.process.send_signal(signal.SIGCONT)
        for thread in clients:
            thread.join(90)
        counts = {str(a): answers.count(a) for a in set(answers)}
        assert len(answers) == burst and set(answers) <= {200, 503} and 200 in answers, counts
    finally:
        assert server.stop() == 0


def _accept_queue(port: int) -> int:
    """The kernel's accept queue of the socket listening on `port` (a listener's rx_queue in /proc/net/tcp)."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                total += int(fields[4].split(":")[1], 16)
    return total


def test_connections_queued_by_the_kernel_at_sigterm_are_answered_not_reset(blob_model_dir, tmp_path):
    """Closing a listening socket resets what the kernel queued and the server had not accepted: a chaos soak's
    SIGTERM under traffic reset 3 clients so. Here a burst lands while the server is stopped, SIGTERM is
    pending, and on SIGCONT the drain finds nothing in flight: before the port was sealed first, the close
    reset every one of them (here all 300)."""
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    if somaxconn < 128:
        pytest.skip(f"net.core.somaxconn is {somaxconn}: too few connections queue to show the close")
    burst = min(300, somaxconn - 8)
    server = start_server({"DETECT_MODEL": str(blob_model_dir)}, tmp_path / "log")
    image = encode(np.full((32, 32, 3), 90, np.uint8), "PNG")
    answers: list = []

    def detect():
        try:
            answers.append(server.request("POST", "/detect", image, {"Content-Type": "image/png"}, timeout=60)[0])
        except OSError as exc:
            answers.append(type(exc).__name__)

    server.process.send_signal(signal.SIGSTOP)  # the reactor accepts nothing while the connections arrive
    try:
        clients = [threading.Thread(target=detect) for _ in range(burst)]
        for thread in clients:
            thread.start()
        wait_for(lambda: _accept_queue(server.port) >= burst, 60, "every connection in the kernel's queue")
        time.sleep(0.5)  # each client sends its request once connected
        server.process.send_signal(signal.SIGTERM)
    finally:
        server.process.send_signal(signal.SIGCONT)
    for thread in clients:
        thread.join(90)
    assert server.process.wait(60) == 0
    counts = {str(a): answers.count(a) for a in set(answers)}
    assert len(answers) == burst and set(answers) == {503}, counts  # draining: each refused in HTTP, none reset
    log = server.log()
    # The reactor may accept some of the burst before it runs the SIGTERM (CI: 100, one accept round); at the seal
    # each connection is either open or still in the kernel's queue.
    sealed = re.search(r"port sealed: no new connection completes; (\d+) queued by the kernel and (\d+) open", log)
    assert sealed, log[-3000:]
    queued, open_ = int(sealed[1]), int(sealed[2])
    assert queued > 0 and queued + open_ == burst, sealed[0]
    assert "resets" not in log and "Traceback" not in log, log[-3000:]


def test_a_connection_that_sends_its_request_slowly_after_sigterm_is_answered_before_the_server_exits(
        blob_model_dir, tmp_path):
    """A client connected before SIGTERM whose request arrives after it, in pieces: the server waits for it
    (within the header and body deadlines and the grace) and answers it, instead of exiting under it."""
    server = start_server({"DETECT_MODEL": str(blob_model_dir)}, tmp_path / "log")
    image = encode(np.full((32, 32, 3), 90, np.uint8), "PNG")
    head = (f"POST /detect HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            f"Content-Length: {len(image)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as client:
        time.sleep(0.3)  # accepted, with no request yet
        server.process.send_signal(signal.SIGTERM)
        time.sleep(4.0)  # past the stop of its workers: the server exited here before it waited for this client
        client.sendall(head)
        time.sleep(1.0)
        client.sendall(image[:10])
        time.sleep(1.0)
        client.sendall(image[10:])
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:300]
    assert b'"not_ready"' in answer
    assert server.process.wait(60) == 0
    assert "Traceback" not in server.log()


def _quietly(server, body):
    try:
        server.request("POST", "/detect", body, {"Content-Type": "image/png"}, timeout=30)
    except OSError:
        pass


def test_a_corrupt_model_stops_the_server_with_status_2(tmp_path):
    version = tmp_path / "broken" / "3"
    version.mkdir(parents=True)
    (version / "saved_model.pb").write_bytes(b"garbage")
    server = start_server({"DETECT_MODEL": str(tmp_path / "broken")}, tmp_path / "log", ready=False)
    assert server.process.wait(120) == 2
    assert f"model {version} cannot be loaded as a SavedModel" in server.log()


def test_an_empty_model_folder_is_refused_before_binding(tmp_path):
    (tmp_path / "empty").mkdir()
    import subprocess
    import sys

    from conftest import ROOT

    result = subprocess.run([sys.executable, "-m", "app", "serve", "--model", str(tmp_path / "empty")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "holds no version" in result.stderr and "listening" not in result.stderr
