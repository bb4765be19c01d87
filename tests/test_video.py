"""POST /detect/video on a real server: tracked NDJSON, annotated MP4, sampling, every limit and bad input, and a
client that goes away, alone and among dozens; the decoder threads, descriptors and memory checked through /proc.

The server serves the blob model (exact answers on coloured squares) and a slow copy of it (a second a call), so
that a video is still running when a test needs it to be.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, start_server, wait_for
from images_for_tests import encode
from videos_for_tests import audio_only, break_frame, make_video, padded, red_and_green

av = pytest.importorskip("av", reason="the video extra (PyAV) is not installed")

MAX_VIDEO_BYTES = 8 * 2**20
IN_FLIGHT = 8


@pytest.fixture(scope="module")
def video_server(blob_model_dir, slow_blob_model_dir, tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    (repository / "blob").symlink_to(blob_model_dir)
    (repository / "slow").symlink_to(slow_blob_model_dir.parent)
    server = start_server({
        "DETECT_MODEL_REPOSITORY": str(repository), "DETECT_DEFAULT_MODEL": "blob", "DETECT_IDLE_UNLOAD_S": "0",
        "DETECT_SPARE_WORKERS": "0", "DETECT_MAX_VIDEO_BYTES": str(MAX_VIDEO_BYTES), "DETECT_MAX_VIDEO_S": "4",
        "DETECT_MAX_VIDEO_FRAMES": "200", "DETECT_MAX_IMAGE_PIXELS": "200000", "DETECT_MAX_VIDEO_FPS": "30",
        "DETECT_VIDEO_FRAMES_IN_FLIGHT": str(IN_FLIGHT), "DETECT_HTTP_THREADS": "64", "DETECT_MAX_VIDEO_STREAMS": "32",
    }, tmp_path_factory.mktemp("video-server") / "server.log")
    yield server
    server.stop()


def post_video(server, body: bytes, path: str = "/detect/video", headers: dict | None = None):
    """POST a video; return (status, headers, the NDJSON records, the error document or the raw body, raw body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, body, {"Content-Type": "video/mp4", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    answer_headers = dict(response.getheaders())
    kind = answer_headers.get("Content-Type", "")
    if kind == "application/x-ndjson":
        return response.status, answer_headers, [json.loads(line) for line in data.splitlines() if line], data
    return response.status, answer_headers, json.loads(data) if kind == "application/json" else data, data


def frames_of(records: list[dict]) -> list[dict]:
    return [r for r in records if "frame" in r]


def metric(server, series: str) -> float:
    text = server.request("GET", "/metrics")[2].decode()
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def process_state(pid: int) -> dict:
    """What /proc says of the server's HTTP process: its threads (FFmpeg's decoder threads apart), descriptors,
    the deleted temporary files it still holds open, and its resident memory."""
    tasks = os.listdir(f"/proc/{pid}/task")
    names = []
    for task in tasks:
        try:
            names.append(Path(f"/proc/{pid}/task/{task}/comm").read_text().strip())
        except OSError:
            continue
    fds = os.listdir(f"/proc/{pid}/fd")
    deleted = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.endswith("(deleted)") and not target.startswith("/memfd:"):  # not the workers' shared lanes
            deleted.append(target)
    rss_kb = int(re.search(r"^VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))
    return {"threads": len(names), "decoder_threads": sum(1 for n in names if n.startswith("av:")),
            "fds": len(fds), "deleted_files": deleted, "rss_mib": rss_kb / 1024}


def test_a_video_is_answered_as_ndjson_a_record_per_frame_with_track_ids(video_server):
    status, headers, records, _ = post_video(video_server, make_video(frames=30))
    assert status == 200, records
    assert headers["Content-Type"] == "application/x-ndjson"
    assert "Content-Length" not in headers  # streamed, chunk by chunk
    video = records[0]["video"]
    assert video["model"]["name"] == "blob" and video["container"] == "mp4" and video["codec"] == "h264"
    assert (video["width"], video["height"], video["frames"], video["fps"], video["sampled_fps"]) == (160, 120, 30,
                                                                                                       30.0, 30.0)
    frames = frames_of(records)
    assert [f["frame"] for f in frames] == list(range(30))
    assert [f["time_s"] for f in frames] == pytest.approx([i / 30 for i in range(30)], abs=1e-3)
    for index, frame in enumerate(frames):
        by_class = {d["class_id"]: d for d in frame["detections"]}
        assert set(by_class) == {1, 2}, frame  # red and green; blue (0.3) is under the threshold, and none is drawn
        x = 4 + 2 * index
        red = by_class[1]["box"]
        assert abs(red["x_min"] - x) <= 2 and abs(red["x_max"] - (x + 30)) <= 2 and abs(red["y_min"] - 20) <= 2
        assert by_class[1]["track_id"] == 1 and by_class[2]["track_id"] == 2
    assert records[-1]["end"]["frames"] == 30 and records[-1]["end"]["tracks"] == 2


@pytest.mark.parametrize("container", ["mp4", "mov", "webm", "matroska"])
def test_mp4_mov_webm_and_mkv_are_taken(video_server, container):
    kind = {"mp4": "video/mp4", "mov": "video/quicktime", "webm": "video/webm", "matroska": "video/x-matroska"}
    status, _, records, _ = post_video(video_server, make_video(frames=12, container=container),
                                       headers={"Content-Type": kind[container]})
    assert status == 200, records
    assert records[0]["video"]["container"] == ("webm" if container == "webm" else container)
    assert len(frames_of(records)) == 12 and "end" in records[-1]


def test_fps_samples_the_video_and_the_default_is_every_frame_up_to_max_video_fps(video_server):
    status, _, records, _ = post_video(video_server, make_video(frames=30), "/detect/video?fps=10")
    assert status == 200
    assert [f["frame"] for f in frames_of(records)] == list(range(0, 30, 3))
    assert records[0]["video"]["sampled_fps"] == 10.0
    status, _, records, _ = post_video(video_server, make_video(frames=60, fps=60))  # max_video_fps is 30 here
    assert [f["frame"] for f in frames_of(records)] == list(range(0, 60, 2))
    assert records[0]["video"]["sampled_fps"] == 30.0


@pytest.mark.parametrize("query, fragment", [
    ("fps=0", "fps must be a number above 0 and at most 30 (max_video_fps)"),
    ("fps=31", "at most 30 (max_video_fps)"),
    ("fps=nan", "fps must be"),
    ("format=gif", "format must be ndjson"),
    ("threshold=2", "threshold must be"),
    ("colour=red", "unknown query parameter 'colour'"),
])
def test_bad_parameters_are_400_naming_them(video_server, query, fragment):
    status, _, answer, _ = post_video(video_server, make_video(frames=3), f"/detect/video?{query}")
    assert status == 400 and fragment in answer["error"]["message"], answer


def test_a_rotated_phone_video_is_answered_upright(video_server):
    """A display matrix of 90 degrees: the frames are turned as a player shows them, and the boxes with them."""
    status, _, records, _ = post_video(video_server, make_video(frames=3, rotation=90))
    assert status == 200
    assert (records[0]["video"]["width"], records[0]["video"]["height"]) == (120, 160)
    green = next(d for d in frames_of(records)[0]["detections"] if d["class_id"] == 2)["box"]
    # the green square at x 100..140, y 70..110 of a 160x120 frame, turned 90 degrees anticlockwise
    assert abs(green["x_min"] - 70) <= 2 and abs(green["y_min"] - 20) <= 2 and abs(green["x_max"] - 110) <= 2


def test_accept_video_mp4_answers_the_video_with_boxes_and_track_ids_drawn(video_server):
    status, headers, body, _ = post_video(video_server, make_video(frames=20), "/detect/video",
                                          {"Accept": "video/mp4"})
    assert status == 200 and headers["Content-Type"] == "video/mp4"
    with av.open(io.BytesIO(body)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 20
    # the red square (class 1) is outlined in class 1's colour, #1f77b4, on the grey around it
    edge = frames[10][16:20, 24:60].reshape(-1, 3).astype(int)
    assert (np.abs(edge - (31, 119, 180)).sum(axis=1) < 60).any()


def test_the_first_line_goes_out_before_the_video_is_decoded_to_the_end(video_server):
    """On the slow model, with at most IN_FLIGHT frames out: the first frame's record comes while most of the
    video is still undecoded, as the frames counter shows."""
    series = 'detect_video_frames_total{model="slow"}'
    before = metric(video_server, series)
    conn = http.client.HTTPConnection("127.0.0.1", video_server.port, timeout=120)
    try:
        conn.request("POST", "/models/slow/detect/video", make_video(frames=120), {"Content-Type": "video/mp4"})
        answer = conn.getresponse()
        assert answer.status == 200
        assert "video" in json.loads(answer.readline())
        assert json.loads(answer.readline())["frame"] == 0
        decoded = metric(video_server, series) - before
        assert decoded <= 2 * IN_FLIGHT + 2, decoded  # of 120
        rest = [json.loads(line) for line in answer.read().splitlines()]
        assert rest[-1]["end"]["frames"] == 120
    finally:
        conn.close()


def noisy(index: int, width: int, height: int) -> np.ndarray:
    """Frames of noise, so that each frame weighs about the same and half the file is half the frames."""
    return np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)


def half(video: bytes) -> bytes:
    return video[:len(video) // 2]


def _chunked_post(port: int, path: str, total: int, chunk: int = 2**20) -> tuple[int, bytes, int]:
    """Send `total` bytes chunked, stopping when the server answers; return its status, answer and bytes sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sent = 0
    try:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: video/mp4\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        block = b"%x\r\n" % chunk + bytes(chunk) + b"\r\n"
        while sent < total:
            try:
                sock.sendall(block)
            except OSError:
                break
            sent += chunk
            sock.settimeout(0)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break
            except BlockingIOError:
                pass
            finally:
                sock.settimeout(30)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply) < reply.index(b"\r\n\r\n") + 50:
            part = sock.recv(65536)
            if not part:
                break
            reply += part
    finally:
        sock.close()
    return int(reply.split()[1]), reply, sent


def test_a_video_over_max_video_bytes_is_refused_as_it_arrives_never_held_whole(video_server):
    # declared: refused from its headers, before a byte of it is read
    status, _, answer, _ = post_video(video_server, padded(make_video(frames=3), MAX_VIDEO_BYTES))
    assert status == 413 and answer["error"]["code"] == "video_too_large", answer
    assert "max_video_bytes" in answer["error"]["message"]
    # chunked: refused once the bytes pass the limit; the server's memory does not take the 64 MiB sent
    pid = video_server.process.pid
    before = process_state(pid)["rss_mib"]
    status, reply, sent = _chunked_post(video_server.port, "/detect/video", 64 * 2**20)
    assert status == 413 and b"max_video_bytes" in reply
    assert sent < 64 * 2**20
    assert process_state(pid)["rss_mib"] - before < 32
    # a video body may be larger than max_body_bytes (2 MiB by default here... 20 MiB): only the video's limit counts
    status, _, records, _ = post_video(video_server, padded(make_video(frames=3), 6 * 2**20))
    assert status == 200 and len(frames_of(records)) == 3


@pytest.mark.parametrize("make, status, code, fragment", [
    (lambda: make_video(frames=150, fps=30), 413, "video_too_large", "longer than 4 s, over the limit (max_video_s)"),
    (lambda: make_video(frames=210, fps=60), 413, "video_too_large", "more than 200 frames, over the limit "
                                                                     "(max_video_frames)"),
    (lambda: make_video(frames=3, size=(640, 480), draw=lambda i, w, h: red_and_green(i, w, h)), 413,
     "image_too_large", "640x480 = 307200 pixels, over the limit of 200000 (max_image_pixels)"),
    (lambda: encode(red_and_green(0), "JPEG"), 415, "unsupported_video_format", "JPEG is not taken"),
    (lambda: b"\x00\x01 not a video at all" * 10, 400, "invalid_video", "not an MP4, MOV, MKV or WebM video"),
    (lambda: b"", 400, "invalid_video", "the body is empty"),
    (lambda: half(make_video(frames=90)), 400, "invalid_video", "truncated"),
    (lambda: half(make_video(frames=30, faststart=False)), 400, "invalid_video", "cannot be read"),
    (lambda: half(make_video(frames=90, container="webm", draw=noisy)), 400, "invalid_video",
     "truncated: it says it lasts 3.00 s"),
    (audio_only, 400, "invalid_video", "has no video stream"),
])
def test_every_bad_video_is_a_clear_4xx_naming_its_limit_and_leaves_nothing_behind(video_server, make, status, code,
                                                                                  fragment):
    got, _, answer, _ = post_video(video_server, make())
    assert (got, answer["error"]["code"]) == (status, code), answer
    assert fragment in answer["error"]["message"], answer
    assert process_state(video_server.process.pid)["decoder_threads"] == 0


def test_a_body_that_is_not_sent_as_a_video_is_415(video_server):
    status, _, answer, _ = post_video(video_server, make_video(frames=3), headers={"Content-Type": "text/plain"})
    assert status == 415 and "video/mp4" in answer["error"]["message"]


def test_a_decoder_error_halfway_ends_the_stream_with_an_error_line_after_the_frames_before_it(video_server):
    status, _, records, _ = post_video(video_server, break_frame(make_video(frames=30), 15))
    assert status == 200
    frames = frames_of(records)
    assert 5 <= len(frames) <= 15 and [f["frame"] for f in frames] == list(range(len(frames)))
    assert records[-1]["error"]["code"] == "invalid_video"
    assert "the decoder failed at frame" in records[-1]["error"]["message"]
    assert records[-1]["frames"] == len(frames)
    assert "end" not in json.dumps(records[-1])


def _open_stream(port: int, body: bytes, path: str = "/models/slow/detect/video"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, body, {"Content-Type": "video/mp4"})
    return conn, conn.getresponse()


def test_a_client_that_goes_away_stops_decoding_drops_its_frames_and_its_temporary_file(video_server):
    pid = video_server.process.pid
    series = 'detect_video_frames_total{model="slow"}'
    gone = 'detect_videos_total{model="slow",outcome="gone"}'
    gone_before = metric(video_server, gone)
    frames_before = metric(video_server, series)
    held_before = process_state(pid)["deleted_files"]
    body = padded(make_video(frames=110), 6 * 2**20)  # over 4 MiB: Twisted spools it to a temporary file
    conn, answer = _open_stream(video_server.port, body)
    assert answer.status == 200
    json.loads(answer.readline())
    json.loads(answer.readline())
    during = process_state(pid)
    assert len(during["deleted_files"]) > len(held_before)  # the spooled body, open and already unlinked
    assert during["decoder_threads"] > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    answer.close()
    conn.close()
    wait_for(lambda: metric(video_server, gone) == gone_before + 1, 30, "the video counted as gone")
    after = wait_for(lambda: (s := process_state(pid))["decoder_threads"] == 0
                     and s["deleted_files"] == held_before and s, 30, "the decoder threads and the file to go")
    assert after["deleted_files"] == held_before
    wait_for(lambda: metric(video_server, 'detect_queue_depth{model="slow"}') == 0, 30, "its frames to leave the queue")
    decoded = metric(video_server, series) - frames_before
    time.sleep(1.5)
    assert metric(video_server, series) - frames_before == decoded < 110  # decoding stopped


def test_dozens_of_videos_some_clients_leaving_the_rest_answered_whole_and_nothing_left_behind(video_server):
    """24 videos at once on the blob model, every third client gone after its first frame, images posted
    meanwhile: the others get every frame; then the threads, descriptors and memory are back where they were."""
    pid = video_server.process.pid
    body = make_video(frames=60)
    image = encode(red_and_green(0), "PNG")

    def one(index: int, results: dict) -> None:
        conn, answer = _open_stream(video_server.port, body, "/detect/video")
        try:
            if index % 3 == 0:
                answer.readline()
                answer.readline()
                conn.sock.shutdown(socket.SHUT_RDWR)
                results[index] = "left"
                return
            records = [json.loads(line) for line in answer.read().splitlines()]
            results[index] = len(frames_of(records)) if "end" in records[-1] else records[-1]
        finally:
            answer.close()
            conn.close()

    def round_of_videos() -> tuple[dict, list[int]]:
        results: dict = {}
        threads = [threading.Thread(target=one, args=(i, results)) for i in range(24)]
        for t in threads:
            t.start()
        statuses = [video_server.request("POST", "/detect", image, {"Content-Type": "image/png"})[0]
                    for _ in range(10)]
        for t in threads:
            t.join(120)
        return results, statuses

    round_of_videos()  # warm: the WSGI threads a round of 24 takes are started, and stay
    wait_for(lambda: process_state(pid)["decoder_threads"] == 0, 30, "the warm round to end")
    before = process_state(pid)
    results, statuses = round_of_videos()
    assert statuses == [200] * 10  # images are answered while the videos run
    assert [results[i] for i in range(24) if i % 3] == [60] * 16, results
    after = wait_for(lambda: (s := process_state(pid))["decoder_threads"] == 0 and s["fds"] <= before["fds"]
                     and s["threads"] <= before["threads"] and s, 30, "threads and descriptors back")
    assert after["deleted_files"] == before["deleted_files"]
    assert after["rss_mib"] - before["rss_mib"] < 40, (before, after)


def test_videos_over_max_video_streams_are_refused_at_once_and_images_still_pass(blob_model_dir, slow_blob_model_dir,
                                                                                tmp_path):
    """Each video holds a request thread for as long as it lasts: past max_video_streams the next is 503 with
    Retry-After, from the reactor, while images (which count in http_threads only) are answered."""
    repository = tmp_path / "repository"
    repository.mkdir()
    (repository / "blob").symlink_to(blob_model_dir)
    (repository / "slow").symlink_to(slow_blob_model_dir.parent)
    server = start_server({"DETECT_MODEL_REPOSITORY": str(repository), "DETECT_DEFAULT_MODEL": "blob",
                           "DETECT_SPARE_WORKERS": "0", "DETECT_MAX_VIDEO_STREAMS": "2"}, tmp_path / "server.log")
    held = []
    try:
        for _ in range(2):
            conn, answer = _open_stream(server.port, make_video(frames=60))
            assert answer.status == 200
            answer.readline()
            held.append((conn, answer))
        status, headers, refusal, _ = post_video(server, make_video(frames=3), "/models/slow/detect/video")
        assert status == 503 and headers["Retry-After"] == "1"
        assert refusal["error"]["code"] == "overloaded" and "(max_video_streams)" in refusal["error"]["message"]
        status, _, answer = server.request("POST", "/detect", encode(red_and_green(0), "PNG"),
                                           {"Content-Type": "image/png"})
        assert status == 200 and len(answer["detections"]) == 2
    finally:
        for conn, answer in held:
            answer.close()
            conn.close()
        server.stop()
