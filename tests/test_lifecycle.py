"""Boot and shutdown of the real server: readiness, SIGTERM with requests in flight, bad models."""

from __future__ import annotations

import re
import signal
import threading
import time

import numpy as np

from conftest import start_server
from images_for_tests import encode


def _in_flight(server) -> int:
    text = server.request("GET", "/metrics")[2].decode()
    return int(float(re.search(r"^detect_http_requests_in_flight (\S+)$", text, re.M).group(1))) - 1  # less this one


def test_sigterm_turns_readiness_503_finishes_requests_in_flight_then_exits_0(blob_model_dir, tmp_path):
    server = start_server({"DETECT_MODEL": str(blob_model_dir), "DETECT_HTTP_THREADS": "2"}, tmp_path / "log")
    big = encode(np.full((1000, 1000, 3), 90, np.uint8), "PNG")  # a small upload, slower to decode and run
    results: list = []

    def send():
        try:
            results.append(server.request("POST", "/detect", big, {"Content-Type": "image/png"})[0])
        except OSError as exc:
            results.append(exc)

    senders = [threading.Thread(target=send) for _ in range(50)]
    for thread in senders:
        thread.start()
    waited = time.monotonic() + 30  # until all 50 are accepted: 2 running, the rest queued for a thread
    while _in_flight(server) < 50 and time.monotonic() < waited:
        time.sleep(0.02)
    assert _in_flight(server) == 50
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    status, _, ready = server.request("GET", "/readyz")
    assert status == 503 and "shutting down" in ready["error"]["message"]
    assert time.monotonic() - started < 1.0
    status, _, refused = server.request("POST", "/detect", big, {"Content-Type": "image/png"})
    assert status == 503 and refused["error"]["code"] == "not_ready"
    for thread in senders:
        thread.join(60)
    status = server.process.wait(30)
    log = server.log()
    assert status == 0, log
    assert results == [200] * 50, log
    assert time.monotonic() - started < 20
    assert "shutting down: not ready" in log and "50 request(s) in flight" in log and "Traceback" not in log


def test_requests_still_running_after_the_grace_are_abandoned_and_the_process_exits(blob_model_dir, tmp_path):
    server = start_server({"DETECT_MODEL": str(blob_model_dir), "DETECT_HTTP_THREADS": "1",
                           "DETECT_SHUTDOWN_GRACE_S": "0"}, tmp_path / "log")
    big = encode(np.full((1500, 1500, 3), 90, np.uint8), "PNG")
    senders = [threading.Thread(target=lambda: _quietly(server, big)) for _ in range(20)]
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
