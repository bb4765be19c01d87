"""The page's camera mode in Chromium with a fake camera, and a video file played back with its tracks.

Chromium's fake camera plays a generated .y4m (tools/sequences.py's shapes moving and crossing) in a loop; the
page sends its frames to the shapes model of a real server, one in flight, and draws boxes and track numbers over
the live picture. Then the committed samples/shapes.mp4 is tracked by the server and drawn as it plays. The
screenshot the docs show (docs/tutorials/camera.png) is the one taken here, in out/page/camera.png.
"""

from __future__ import annotations

import http.client
import json
import time

import pytest

from conftest import ROOT, start_server, wait_for
from test_page import CHROMIUM, CHROMIUM_ARGS, SHOTS, Watched, _sync_playwright

pytestmark = pytest.mark.browser
pytest.importorskip("av", reason="the video extra (PyAV) is not installed")


@pytest.fixture(scope="module")
def camera_server(tmp_path_factory):
    server = start_server({"DETECT_MODEL_REPOSITORY": str(ROOT / "models"), "DETECT_IDLE_UNLOAD_S": "0",
                           "DETECT_SPARE_WORKERS": "0"}, tmp_path_factory.mktemp("camera") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def camera_browser(tmp_path_factory):
    from tools.sequences import shapes_sequence, write_y4m

    sync_playwright = _sync_playwright()
    scratch = tmp_path_factory.mktemp("fake-camera")
    y4m = write_y4m(shapes_sequence(seed=0, frames=150), scratch / "camera.y4m")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(scratch / "profile"), executable_path=CHROMIUM, headless=True, viewport={"width": 1400, "height": 1100},
            args=[*CHROMIUM_ARGS, "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
                  f"--use-file-for-fake-video-capture={y4m}"], permissions=["camera"])
        yield context
        context.close()


@pytest.fixture
def page(camera_browser, camera_server):
    watched = Watched(camera_browser, camera_server)
    watched.page.select_option("#model", "shapes")
    yield watched
    watched.close()


def shown_tracks(page) -> set[str]:
    return set(page.page.evaluate("() => [...document.querySelectorAll('#camera-tracks li')]"
                                  ".map((li) => li.dataset.track).filter((t) => t)"))


def coloured_pixels(page) -> int:
    """Pixels of the overlay canvas in one of the class colours: the boxes drawn."""
    return page.page.evaluate("""() => {
        const canvas = document.querySelector('#camera-canvas');
        const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        const colours = CLASS_COLOURS.slice(0, 4).map((c) => [1, 3, 5].map((i) => parseInt(c.slice(i, i + 2), 16)));
        let count = 0;
        for (let i = 0; i < data.length; i += 4) {
            if (data[i + 3] > 200 && colours.some(([r, g, b]) => Math.abs(data[i] - r) + Math.abs(data[i + 1] - g)
                + Math.abs(data[i + 2] - b) < 24)) count += 1;
        }
        return count;
    }""")


def test_the_camera_mode_keeps_one_frame_in_flight_and_draws_tracked_boxes(page, camera_server):
    in_flight, most = [0], [0]

    def sent(request):
        if "/detect" in request.url:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])

    def done(request):
        if "/detect" in request.url:
            in_flight[0] -= 1

    page.page.on("request", sent)
    page.page.on("requestfinished", done)
    page.page.on("requestfailed", done)
    page.page.click("#camera-start")
    def frames(count: int):
        return lambda: int(page.page.evaluate("() => document.body.dataset.cameraFrames || 0")) >= count

    wait_for(frames(8), 120, "eight camera frames answered")
    early = shown_tracks(page)
    wait_for(frames(16), 120, "sixteen camera frames answered")
    later = shown_tracks(page)
    status = page.page.inner_text("#camera-status")
    assert "frames/s, one frame in flight" in status and status.startswith("shapes v1: ")
    rate = float(status.split(": ")[1].split(" frames/s")[0])
    assert rate > 0
    assert most[0] == 1  # never a second frame before the answer to the first
    assert early and later and early & later, (early, later)  # objects keep their numbers from frame to frame
    assert coloured_pixels(page) > 100
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.page.locator("#camera").screenshot(path=str(SHOTS / "camera.png"))
    page.page.click("#camera-stop")
    count = int(page.page.evaluate("() => document.body.dataset.cameraFrames"))
    time.sleep(1.0)
    assert int(page.page.evaluate("() => document.body.dataset.cameraFrames")) <= count + 1  # stopped
    assert page.problems == []


def test_a_video_file_is_tracked_by_the_server_and_drawn_as_it_plays(page, camera_server):
    sample = ROOT / "samples" / "shapes.mp4"
    page.page.set_input_files("#video-file", str(sample))
    wait_for(lambda: page.page.evaluate("() => document.body.dataset.videoDone"), 120, "the video's answer to end")
    status = page.page.inner_text("#camera-status")
    assert status.startswith("shapes.mp4: 150 frames, ") and " tracks, tracked in " in status
    assert int(page.page.evaluate("() => document.body.dataset.videoFrames")) == 150
    wait_for(lambda: shown_tracks(page), 30, "tracks drawn over the playing video")
    assert coloured_pixels(page) > 100
    # what the page draws is what the server answers for that file
    conn = http.client.HTTPConnection("127.0.0.1", camera_server.port, timeout=120)
    try:
        conn.request("POST", "/models/shapes/detect/video?threshold=0.50", sample.read_bytes(),
                     {"Content-Type": "video/mp4"})
        records = [json.loads(line) for line in conn.getresponse().read().splitlines()]
    finally:
        conn.close()
    ids = {str(d["track_id"]) for r in records if "frame" in r for d in r["detections"] if d["track_id"] is not None}
    assert shown_tracks(page) <= ids
    # Not failures: Chromium's media player reads a blob: URL in ranges and aborts the reads it no longer needs, and
    # Chromium reports a fetch whose body a script read to its end through a stream reader as ERR_ABORTED (a
    # fetch of the same answer read with text() is reported finished; every record arrived, as checked above).
    assert [p for p in page.problems if not ("ERR_ABORTED" in p and (
        p.startswith("request failed: blob:") or "/detect/video" in p))] == []
