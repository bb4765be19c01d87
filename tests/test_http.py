"""The full HTTP path against a real server in a subprocess: each input form and every error status."""

from __future__ import annotations

import base64
import http.client
import json
import platform
import re
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from blob_model import blob_image
from images_for_tests import ORIENT, encode

RED_GREEN = blob_image(64, 48, {1: (10, 5, 20, 15), 2: (30, 20, 50, 40)})
BLUE = blob_image(40, 30, {3: (2, 3, 12, 13)})
EMPTY = blob_image(32, 32, {})


def boxes(answer):
    return [(d["class_id"], d["box"]["x_min"], d["box"]["y_min"], d["box"]["x_max"], d["box"]["y_max"])
            for d in answer["detections"]]


def multipart(fields: list[tuple[str, bytes]], boundary: str = "testboundary") -> tuple[bytes, dict]:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="f{i}.png"\r\n'
        f"Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n"
        for i, (name, data) in enumerate(fields)
    ]
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def test_raw_png_body(server):
    status, _, answer = server.request("POST", "/detect", encode(RED_GREEN), {"Content-Type": "image/png"})
    assert status == 200
    assert answer["model"] == {"name": "blob", "version": "2"}
    assert (answer["width"], answer["height"]) == (64, 48)
    assert boxes(answer) == [(1, 10.0, 5.0, 20.0, 15.0), (2, 30.0, 20.0, 50.0, 40.0)]
    assert [d["label"] for d in answer["detections"]] == ["Red blob", "green"]
    assert set(answer["timing_ms"]) == {"decode", "inference", "total"}


@pytest.mark.parametrize("fmt, kind", [("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("BMP", "image/bmp"),
                                        ("GIF", "image/gif")])
def test_raw_bodies_of_each_format(server, fmt, kind):
    save = {"quality": 100, "subsampling": 0} if fmt == "JPEG" else ({"lossless": True} if fmt == "WEBP" else {})
    status, _, answer = server.request("POST", "/detect", encode(RED_GREEN, fmt, **save), {"Content-Type": kind})
    assert status == 200, answer
    assert [d["class_id"] for d in answer["detections"]] == [1, 2]


def test_multipart_with_several_images_answers_in_upload_order(server):
    body, headers = multipart([("image", encode(BLUE)), ("image", encode(EMPTY)), ("image", encode(RED_GREEN))])
    status, _, answer = server.request("POST", "/detect?threshold=0.2", body, headers)
    assert status == 200
    assert [(r["width"], r["height"]) for r in answer["results"]] == [(40, 30), (32, 32), (64, 48)]
    assert [[d["class_id"] for d in r["detections"]] for r in answer["results"]] == [[3], [], [1, 2]]


def test_multipart_with_one_image_answers_as_one(server):
    body, headers = multipart([("image", encode(BLUE))])
    status, _, answer = server.request("POST", "/detect?threshold=0.2", body, headers)
    assert status == 200 and "results" not in answer and boxes(answer) == [(3, 2.0, 3.0, 12.0, 13.0)]


def test_json_single_image(server):
    body = json.dumps({"image": base64.b64encode(encode(RED_GREEN)).decode()}).encode()
    status, _, answer = server.request("POST", "/detect", body, {"Content-Type": "application/json"})
    assert status == 200 and [d["class_id"] for d in answer["detections"]] == [1, 2]


def test_json_images_list_keeps_order_and_the_list_shape(server):
    images = [EMPTY, RED_GREEN, BLUE, RED_GREEN]
    body = json.dumps({"images": [base64.b64encode(encode(i)).decode() for i in images]}).encode()
    status, _, answer = server.request("POST", "/detect?threshold=0.1", body, {"Content-Type": "application/json"})
    assert status == 200
    assert [[d["class_id"] for d in r["detections"]] for r in answer["results"]] == [[], [1, 2], [3], [1, 2]]
    one = json.dumps({"images": [base64.b64encode(encode(BLUE)).decode()]}).encode()
    status, _, answer = server.request("POST", "/detect?threshold=0.1", one, {"Content-Type": "application/json"})
    assert status == 200 and len(answer["results"]) == 1


@pytest.mark.parametrize("threshold, expected", [("0.95", []), ("0.5", [1, 2]), ("0", [1, 2])])
def test_threshold(server, threshold, expected):
    status, _, answer = server.request("POST", f"/detect?threshold={threshold}", encode(RED_GREEN),
                                       {"Content-Type": "image/png"})
    assert status == 200 and [d["class_id"] for d in answer["detections"]] == expected


def test_max_detections(server):
    status, _, answer = server.request("POST", "/detect?max_detections=1", encode(RED_GREEN),
                                       {"Content-Type": "image/png"})
    assert status == 200 and [d["class_id"] for d in answer["detections"]] == [1]


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_boxes_are_in_the_image_as_the_user_sees_it_after_exif_orientation(server, orientation):
    stored = blob_image(60, 40, {1: (5, 10, 15, 20)})
    data = encode(stored, "JPEG", orientation=orientation, quality=100, subsampling=0)
    status, _, answer = server.request("POST", "/detect", data, {"Content-Type": "image/jpeg"})
    assert status == 200
    seen = ORIENT[orientation](stored)
    ys, xs = np.nonzero(seen[..., 0] > 200)
    assert (answer["width"], answer["height"]) == (seen.shape[1], seen.shape[0])
    ((_, x0, y0, x1, y1),) = boxes(answer)
    assert (x0, y0, x1, y1) == pytest.approx((xs.min(), ys.min(), xs.max() + 1, ys.max() + 1), abs=1.0)


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _bomb_png():
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 100)))


@pytest.mark.parametrize(
    "path, body, kind, status, code, fragment",
    [
        ("/detect", b"not an image", "image/jpeg", 400, "invalid_image", "not a JPEG, PNG"),
        ("/detect", encode(RED_GREEN, "JPEG")[:300], "image/jpeg", 400, "invalid_image", "header cannot be read"),
        ("/detect", _half(encode(blob_image(640, 480, {1: (0, 0, 9, 9)}), "JPEG")), "image/jpeg", 400,
         "invalid_image", "corrupt or truncated"),
        ("/detect", b"", "image/png", 400, "invalid_image", "empty"),
        ("/detect?threshold=2", encode(EMPTY), "image/png", 400, "invalid_parameter", "threshold must be"),
        ("/detect?threshold=nan", encode(EMPTY), "image/png", 400, "invalid_parameter", "threshold must be"),
        ("/detect?max_detections=0", encode(EMPTY), "image/png", 400, "invalid_parameter", "max_detections"),
        ("/detect?max_detections=1000000000", encode(EMPTY), "image/png", 400, "invalid_parameter", "1 to 1000"),
        ("/detect?treshold=0.5", encode(EMPTY), "image/png", 400, "invalid_parameter", "unknown query parameter"),
        ("/detect", b"{not json", "application/json", 400, "invalid_body", "not valid JSON"),
        ("/detect", b'{"image": "***"}', "application/json", 400, "invalid_body", "not valid base64"),
        ("/detect", b'{"picture": "AAAA"}', "application/json", 400, "invalid_body", "exactly one of"),
        ("/detect", b"[" * 100000 + b"]" * 100000, "application/json", 400, "invalid_body", "not valid JSON"),
        ("/detect", encode(EMPTY), "text/plain", 415, "unsupported_content_type", "text/plain"),
        ("/detect", encode(EMPTY), "", 415, "unsupported_content_type", "'none'"),
        ("/detect", b"II*\x00" + b"\x00" * 64, "image/png", 415, "unsupported_image_format", "TIFF"),
        ("/detect", b"%!PS-Adobe-3.0 EPSF-3.0\n", "image/png", 415, "unsupported_image_format", "EPS"),
        ("/detect", _bomb_png(), "image/png", 413, "image_too_large", "30000x30000"),
    ],
)
def test_bad_requests_get_a_json_error_with_the_right_status(server, path, body, kind, status, code, fragment):
    headers = {"Content-Type": kind} if kind else {}
    got, _, answer = server.request("POST", path, body, headers)
    assert got == status, answer
    assert answer["error"]["code"] == code
    assert fragment in answer["error"]["message"]


def test_too_many_images(server):
    body, headers = multipart([("image", encode(EMPTY))] * 5)
    status, _, answer = server.request("POST", "/detect", body, headers)
    assert status == 400 and "at most 4" in answer["error"]["message"]


def test_multipart_without_an_image_field(server):
    body, headers = multipart([("photo", encode(EMPTY))])
    status, _, answer = server.request("POST", "/detect", body, headers)
    assert status == 400 and "no 'image' file field (it has 'photo')" in answer["error"]["message"]


def test_unknown_route_and_wrong_method(server):
    status, _, answer = server.request("GET", "/nope")
    assert status == 404 and answer["error"]["code"] == "not_found"
    status, headers, answer = server.request("GET", "/detect")
    assert status == 405 and answer["error"]["code"] == "method_not_allowed" and "POST" in headers["Allow"]


def test_a_body_over_the_limit_is_refused_by_content_length(server):
    status, _, answer = server.request("POST", "/detect", b"\x00" * (2 * 2**20 + 1), {"Content-Type": "image/png"})
    assert status == 413 and answer["error"]["code"] == "body_too_large"


def test_a_chunked_body_over_the_limit_is_refused(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    chunks = (b"\x00" * 65536 for _ in range(64))  # 4 MiB against a 2 MiB limit
    try:
        conn.request("POST", "/detect", body=chunks, headers={"Content-Type": "image/png"}, encode_chunked=True)
        response = conn.getresponse()
        status, answer = response.status, json.loads(response.read())
    except (BrokenPipeError, ConnectionResetError):
        pytest.fail("the server reset the connection instead of answering 413")
    finally:
        conn.close()
    assert status == 413 and answer["error"]["code"] == "body_too_large"


def test_a_chunked_body_under_the_limit_is_served(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    data = encode(RED_GREEN)
    try:
        conn.request("POST", "/detect", body=iter([data[:100], data[100:]]),
                     headers={"Content-Type": "image/png"}, encode_chunked=True)
        response = conn.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        conn.close()
    assert status == 200 and [d["class_id"] for d in answer["detections"]] == [1, 2]


def test_health_readiness_and_gpu(server):
    assert server.request("GET", "/healthz")[:1] == (200,)
    status, _, ready = server.request("GET", "/readyz")
    assert status == 200 and ready["models"] == [{"name": "blob", "version": "2", "state": "ready"}]
    status, _, gpu = server.request("GET", "/gpu")
    assert status == 200 and gpu["available"] is False and "NVML" in gpu["reason"]
    (worker,) = gpu["workers"]
    assert (worker["model"], worker["version"], worker["policy"]["spec"]) == ("blob", "2", "4096MiB")
    assert worker["pid"] != server.process.pid


def test_metrics_count_requests_and_model_calls(server):
    server.request("POST", "/detect", encode(EMPTY), {"Content-Type": "image/png"})
    status, _, text = server.request("GET", "/metrics")
    text = text.decode()
    assert status == 200
    assert 'detect_http_requests_total{model="blob",route="/detect",status="200"}' in text
    assert 'detect_http_request_duration_seconds_bucket{le="0.005",model="blob",route="/detect"}' in text
    assert 'detect_inference_duration_seconds_count{model="blob"}' in text
    assert 'detect_images_per_model_call_bucket{le="1.0",model="blob"}' in text
    assert 'detect_model_loaded{model="blob"} 1.0' in text and 'detect_model_loads_total{model="blob"} 1.0' in text
    assert re.search(r'^detect_model_memory_bytes\{model="blob",source="rss"\} [1-9]', text, re.M)


def _stage_counts(server) -> dict[str, float]:
    status, _, text = server.request("GET", "/metrics")
    assert status == 200
    return {stage: float(count) for stage, count in re.findall(
        r'^detect_request_stage_seconds_count\{model="blob",stage="(\w+)"\} (\S+)', text.decode(), re.M)}


def test_timing_stages_say_where_a_request_s_time_went_and_metrics_keep_every_stage(server):
    image = encode(blob_image(64, 48, {1: (8, 8, 30, 30)}))
    before = _stage_counts(server)  # the server is shared: other tests' requests (gRPC too) are counted already
    status, _, body = server.request("POST", "/detect?timing=stages", image, {"Content-Type": "image/png"})
    assert status == 200
    timing = body["timing_ms"]
    stages = timing["stages"]
    # In the order a request meets them; `load` only when it waited for one; encode and write end after the body.
    assert list(stages) == ["receive", "decode", "queue", "batch", "send", "inference", "return", "wake"]
    assert all(ms >= 0 for ms in stages.values()) and stages["inference"] > 0
    # The stages from the handler on follow one another without gaps: they add up to the app's own total.
    assert sum(ms for stage, ms in stages.items() if stage != "receive") == pytest.approx(timing["total"], abs=1.0)
    status, _, _ = server.request("POST", "/detect?timing=everything", image, {"Content-Type": "image/png"})
    assert status == 400
    added = {stage: count - before.get(stage, 0.0) for stage, count in _stage_counts(server).items()}
    # The one request that ran images was observed once in every stage it met, `write` included; the 400 in none.
    assert {stage for stage, count in added.items() if count} == {
        "receive", "decode", "queue", "batch", "send", "inference", "return", "wake", "encode", "write"}
    assert all(count in (0.0, 1.0) for count in added.values()), added


def _minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])  # minflt, proc(5)


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or platform.libc_ver()[0] != "glibc",
                    reason="counts page faults from /proc; the allocator settings are glibc's")
def test_a_decode_s_buffers_stay_in_the_heap_from_one_request_to_the_next(server):
    """With glibc's defaults, the request threads gave a 640x480 decode's buffers (about 3 MB) back to the kernel
    after each request and faulted them in again on the next: some 700 page faults and 1.5 ms a request."""
    image = encode(blob_image(640, 480, {1: (8, 8, 300, 200)}), "JPEG", quality=90)
    for _ in range(10):  # every request thread the next ones may run in has decoded once
        assert server.request("POST", "/detect", image, {"Content-Type": "image/jpeg"})[0] == 200
    before = _minor_faults(server.process.pid)
    for _ in range(20):
        assert server.request("POST", "/detect", image, {"Content-Type": "image/jpeg"})[0] == 200
    per_request = (_minor_faults(server.process.pid) - before) / 20
    assert per_request < 150, f"{per_request:.0f} page faults a request in the HTTP process"
    assert "memory allocator for decoding: glibc:" in server.log()


def test_every_request_leaves_one_access_log_line(server):
    server.request("GET", "/healthz?probe=access-log")
    deadline = time.monotonic() + 15  # the line is written once the response has gone out
    while "probe=access-log" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in server.log().splitlines() if "probe=access-log" in line]
    assert len(lines) == 1 and re.search(r"app\.access: GET /healthz\?probe=access-log 200 [\d.]+ms$", lines[0]), server.log()[-800:]


def test_no_traceback_ever_left_the_server(server):
    """Run last in this module: after every bad request above, the log has no traceback and the server is up."""
    assert server.process.poll() is None
    assert "Traceback" not in server.log()


def test_a_malformed_request_line_does_not_crash_the_server(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 400")
    assert server.request("GET", "/healthz")[0] == 200


def test_headers_dripped_slowly_are_cut_off_while_normal_clients_are_served(server):
    """Slowloris: the header deadline (1 s in this server) closes the drip; others are answered meanwhile."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /detect HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 8:
            try:
                sock.sendall(b"X-Drip: 1\r\n")
                assert server.request("GET", "/healthz", timeout=5)[0] == 200
                if sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.2)
        assert closed, "the dripping connection was never closed"
        assert time.monotonic() - started < 4


def test_a_body_that_stalls_is_closed_at_the_body_deadline(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /detect HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 1000\r\n\r\n")
        sock.sendall(b"\x89PNG")
        started = time.monotonic()
        try:
            data = sock.recv(100)  # blocks until the server closes
        except ConnectionResetError:
            data = b""
        assert data == b"" and 1.5 <= time.monotonic() - started < 6
    assert server.request("GET", "/healthz")[0] == 200
