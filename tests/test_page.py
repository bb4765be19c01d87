"""The page at GET /, driven in a real browser: Playwright and Debian's Chromium against a real server.

The server serves the shipped faces and shapes models from the repository. The page is checked the way
a user sees it: the boxes it draws over the displayed image (EXIF-rotated photos included) against the
API's own answer, the memory panel as a worker comes and goes, and no console error or failed request
along the way. Screenshots land in out/page/. Without Chromium (or Playwright) these tests skip and say
so, as the gpu tests do without a GPU.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, start_server, wait_for
from images_for_tests import encode

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("DETECT_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]
SHOTS = ROOT / "out" / "page"


def _sync_playwright():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (it is in the test extra)")
    return sync_playwright


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("page") / "server.log"
    server = start_server({"DETECT_MODEL_REPOSITORY": str(ROOT / "models"), "DETECT_IDLE_UNLOAD_S": "0",
                           "DETECT_SPARE_WORKERS": "0"}, log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    sync_playwright = _sync_playwright()
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000})
        yield context
        context.close()


class Watched:
    """A page and everything that went wrong in it: console errors, page errors, failed requests."""

    def __init__(self, context, server):
        self.server = server
        self.page = context.new_page()
        self.problems: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.problems.append(f"console: {m.text}"))
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("requestfailed", lambda r: self.problems.append(f"request failed: {r.url} {r.failure}"))
        self.page.on("response", lambda r: r.status >= 400 and self.problems.append(f"{r.status}: {r.url}"))
        self.page.goto(f"http://127.0.0.1:{server.port}/")
        self.polls_past(0)

    def until(self, expression: str, arg=None, timeout_s: float = 30, what: str = ""):
        """Poll `expression` (a JS function of `arg`) until it is truthy; return its value.

        Playwright's wait_for_function evaluates strings inside the page, which the page's own
        Content-Security-Policy forbids ('unsafe-eval' is not allowed), so this polls from here.
        """
        return wait_for(lambda: self.page.evaluate(expression, arg), timeout_s, what or expression)

    def polls_past(self, count: int, timeout_s: float = 30) -> int:
        """Wait until the memory panel has updated more than `count` times; return the count."""
        return self.until("(count) => { const n = Number(document.body.dataset.polls || 0); return n > count && n; }",
                          count, timeout_s, f"the memory panel's update {count + 1}")

    def detect(self, model: str, path: Path) -> None:
        """Choose `model`, give the page the file at `path`, and wait for its answer to be drawn."""
        self.page.select_option("#model", model)
        before = self.page.inner_text("#status")
        self.page.set_input_files("#file", str(path))
        self.until("(before) => { const s = document.querySelector('#status').textContent;"
                   " return s !== before && !s.startsWith('Asking') || !document.querySelector('#error').hidden; }",
                   before, 60, f"an answer from {model}")

    def drawn_boxes(self) -> list[dict]:
        """The drawn boxes in image pixels, measured from their rectangles on screen, with their labels."""
        return self.page.evaluate("""() => {
            const img = document.querySelector('#photo').getBoundingClientRect();
            return [...document.querySelectorAll('#boxes .box')].map((box) => {
                const r = box.getBoundingClientRect();
                return {label: box.textContent, left: r.left - img.left, top: r.top - img.top,
                        right: r.right - img.left, bottom: r.bottom - img.top,
                        shown_width: img.width, shown_height: img.height};
            });
        }""")

    def close(self):
        self.page.close()


@pytest.fixture
def watched(browser, page_server):
    page = Watched(browser, page_server)
    yield page
    page.close()


def _api(server, model: str, body: bytes) -> dict:
    status, _, answer = server.request("POST", f"/models/{model}/detect?threshold=0.50", body,
                                       {"Content-Type": "image/png"})
    assert status == 200, answer
    return answer


def _assert_boxes_match(drawn: list[dict], answer: dict) -> None:
    """Each drawn rectangle is the API's box scaled to the displayed image, within 2 px."""
    assert len(drawn) == len(answer["detections"])
    for box, detection in zip(drawn, answer["detections"]):
        sx, sy = box["shown_width"] / answer["width"], box["shown_height"] / answer["height"]
        b = detection["box"]
        expected = (b["x_min"] * sx, b["y_min"] * sy, b["x_max"] * sx, b["y_max"] * sy)
        measured = (box["left"], box["top"], box["right"], box["bottom"])
        assert max(abs(m - e) for m, e in zip(measured, expected)) <= 2.0, (measured, expected)
        assert box["label"].startswith(detection["label"] + " ")


@pytest.fixture(scope="module")
def astronaut(tmp_path_factory) -> tuple[np.ndarray, Path]:
    import skimage.data

    pixels = skimage.data.astronaut()
    path = tmp_path_factory.mktemp("images") / "astronaut.png"
    path.write_bytes(encode(pixels))
    return pixels, path


def test_the_page_and_its_files_come_from_this_origin_only(page_server):
    status, headers, body = page_server.request("GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    policy = headers["Content-Security-Policy"]
    assert "default-src 'self'" in policy and "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "'unsafe-inline'" not in policy and "*" not in policy
    assert "Access-Control-Allow-Origin" not in headers  # no cors_origins: no CORS at all
    page = body.decode()
    assert "<script>" not in page and " style=" not in page and "http" not in page.replace("http-equiv", "")
    for name, kind in (("page.js", "text/javascript"), ("page.css", "text/css"), ("favicon.svg", "image/svg+xml")):
        status, headers, _ = page_server.request("GET", f"/static/{name}")
        assert status == 200 and headers["Content-Type"].startswith(kind), name
    status, _, answer = page_server.request("GET", "/static/page.py")  # only the page's files, by name
    assert status == 404 and "page.js" in answer["error"]["message"]
    assert page_server.request("GET", "/static/..%2Fpage.py")[0] == 404


def test_astronaut_with_faces_draws_one_face_box_where_the_api_says(watched, page_server, astronaut):
    _, path = astronaut
    watched.detect("faces", path)
    answer = _api(page_server, "faces", path.read_bytes())
    assert [d["label"] for d in answer["detections"]] == ["face"]
    drawn = watched.drawn_boxes()
    assert len(drawn) == 1 and drawn[0]["label"].startswith("face ")
    _assert_boxes_match(drawn, answer)
    assert watched.page.inner_text("#detections").startswith("face")
    timing = watched.page.inner_text("#timing")
    assert "512×512 px" in timing and "decode" in timing and "inference" in timing
    SHOTS.mkdir(parents=True, exist_ok=True)
    watched.polls_past(watched.polls_past(0))  # the chart has a few samples
    watched.page.screenshot(path=str(SHOTS / "faces-desktop.png"), full_page=True)
    assert watched.problems == []


def test_the_page_opens_on_the_default_model_and_lists_what_each_model_finds(watched, page_server, astronaut):
    """objects, the default, is chosen and its 80 COCO labels listed; choosing faces lists its one; a
    photo of the astronaut to objects is boxed as a person."""
    page = watched.page
    assert page.input_value("#model") == "objects"
    labels = watched.until("() => document.querySelector('#model-labels').textContent", what="the labels")
    assert labels.startswith("objects finds 80 labels: person, bicycle, car, motorcycle,") and "toothbrush" in labels
    _, path = astronaut
    watched.detect("objects", path)
    assert [d["label"] for d in _api(page_server, "objects", path.read_bytes())["detections"]] == ["person"]
    assert [box["label"].split()[0] for box in watched.drawn_boxes()] == ["person"]
    page.select_option("#model", "faces")
    assert page.inner_text("#model-labels") == "faces finds one label: face"
    assert watched.problems == []


def test_an_exif_rotated_photo_is_boxed_as_it_is_shown(watched, page_server, astronaut, tmp_path):
    # Stored sideways with orientation 6 ("rotate 90 clockwise to view"): the browser shows it upright,
    # the server detects on the upright image, and the box lands on the face as shown.
    pixels, _ = astronaut
    path = tmp_path / "sideways.jpg"
    path.write_bytes(encode(np.ascontiguousarray(np.rot90(pixels[:, :448], k=1)), "JPEG", orientation=6,
                            quality=95))
    watched.detect("faces", path)
    answer = _api(page_server, "faces", path.read_bytes())
    assert (answer["width"], answer["height"]) == (448, 512) and len(answer["detections"]) == 1
    drawn = watched.drawn_boxes()
    assert drawn[0]["shown_width"] < drawn[0]["shown_height"]  # shown upright: portrait, as the server saw it
    _assert_boxes_match(drawn, answer)
    assert watched.problems == []


def test_a_shapes_scene_is_boxed_with_its_shapes(watched, page_server, tmp_path):
    from app.training.data import CLASSES, scene

    shot = scene("heldout", 0, 0)
    path = tmp_path / "scene.png"
    path.write_bytes(encode(np.asarray(shot.image)))
    watched.detect("shapes", path)
    answer = _api(page_server, "shapes", path.read_bytes())
    drawn = watched.drawn_boxes()
    assert len(drawn) >= 1
    _assert_boxes_match(drawn, answer)
    # every drawn box sits on a shape of its class in the scene (IoU >= 0.5 with the truth)
    truth = [(CLASSES[c - 1], box) for c, box in zip(shot.classes, shot.boxes)]
    for detection in answer["detections"]:
        b = detection["box"]
        best = max((_iou((b["x_min"], b["y_min"], b["x_max"], b["y_max"]), box)
                    for label, box in truth if label == detection["label"]), default=0.0)
        assert best >= 0.5, (detection, truth)
    listed = watched.page.locator("#detections li .label").all_inner_texts()
    assert listed == [d["label"] for d in answer["detections"]]
    assert watched.page.inner_text("#status").startswith("shapes v1 found")
    assert watched.problems == []


@pytest.mark.parametrize("gesture", ["drop", "paste"])
def test_an_image_dropped_or_pasted_is_asked_about_like_a_chosen_file(watched, page_server, gesture):
    from app.training.data import scene

    body = encode(np.asarray(scene("heldout", 0, 1).image))
    watched.page.select_option("#model", "shapes")
    with watched.page.expect_response(lambda r: "/models/shapes/detect" in r.url) as answered:
        watched.page.evaluate("""([gesture, b64]) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const data = new DataTransfer();
            data.items.add(new File([bytes], 'scene.png', {type: 'image/png'}));
            if (gesture === 'drop') {
                document.querySelector('#drop').dispatchEvent(
                    new DragEvent('drop', {dataTransfer: data, bubbles: true, cancelable: true}));
            } else {
                document.dispatchEvent(new ClipboardEvent('paste', {clipboardData: data, bubbles: true}));
            }
        }""", [gesture, base64.b64encode(body).decode()])
    assert answered.value.status == 200
    watched.until("() => document.querySelector('#status').textContent.startsWith('shapes v1 found')")
    expected = _api(page_server, "shapes", body)
    _assert_boxes_match(watched.drawn_boxes(), expected)
    assert watched.problems == []


def test_the_threshold_slider_asks_again_with_its_threshold(watched, astronaut):
    _, path = astronaut
    watched.detect("faces", path)
    with watched.page.expect_request(lambda r: "/models/faces/detect?threshold=1.00" in r.url):
        watched.page.locator("#threshold").fill("1")
    watched.until("() => document.querySelector('#status').textContent.includes('threshold 1.00')")
    assert watched.page.locator("#boxes .box").count() == 0
    assert watched.page.inner_text("#detections") == "nothing above the threshold"
    assert watched.problems == []


def test_the_servers_error_is_shown_in_words(watched, tmp_path):
    path = tmp_path / "not-an-image.png"
    path.write_bytes(b"these bytes are no PNG")
    watched.detect("faces", path)
    status, _, answer = watched.server.request("POST", "/models/faces/detect", path.read_bytes(),
                                               {"Content-Type": "image/png"})
    error = watched.page.locator("#error")
    assert error.is_visible()
    assert status == 400 and error.inner_text() == f"Error 400: {answer['error']['message']}"
    # the 400 is the only thing that went wrong, and the browser logged it as such
    assert all("400" in problem for problem in watched.problems) and watched.problems


def test_the_memory_panel_shows_a_worker_go_on_unload_and_come_back_on_load(watched, page_server):
    page = watched.page
    row = page.locator('#models-body tr[data-model="shapes"]')
    assert row.get_attribute("data-state") == "ready"
    pid = int(page.locator('#models-body tr[data-model="shapes"] td.worker').inner_text())
    assert page.locator(f'#devices tr[data-pid="{pid}"]').count() == 1
    assert "GPU caps are not enforced" in page.inner_text("#memory-note")  # this host has no GPU
    row.get_by_role("button", name="Unload shapes").click()
    page.wait_for_selector('#models-body tr[data-model="shapes"][data-state="unloaded"]', timeout=30_000)
    assert page.locator(f'#devices tr[data-pid="{pid}"]').count() == 0
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10, "the worker's exit")  # gone, not only its row
    assert page.locator('#models-body tr[data-model="faces"][data-state="ready"]').count() == 1
    # the server's history saw it: the shapes series ends in an unloaded sample holding nothing
    history = json.loads(page.evaluate("fetch('/gpu/history').then((r) => r.text())"))
    shapes = next(s for s in history["series"] if s["name"] == "shapes")
    wait_for(lambda: _last_state(page_server, "shapes") == ("unloaded", 0.0), 10, "an unloaded sample")
    assert any(sample[3] == "ready" and sample[1] > 0 for sample in shapes["samples"])
    page.locator('#models-body tr[data-model="shapes"]').get_by_role("button", name="Load shapes").click()
    page.wait_for_selector('#models-body tr[data-model="shapes"][data-state="ready"]', timeout=60_000)
    again = int(page.locator('#models-body tr[data-model="shapes"] td.worker').inner_text())
    page.wait_for_selector(f'#devices tr[data-pid="{again}"]', timeout=10_000)
    assert again != pid
    watched.polls_past(watched.polls_past(0))
    legend = page.locator("#legend").inner_text()
    assert "faces:" in legend and "shapes:" in legend and "HTTP process:" in legend
    page.screenshot(path=str(SHOTS / "after-reload.png"), full_page=True)
    assert watched.problems == []


def _last_state(server, name: str):
    history = server.request("GET", "/gpu/history")[2]
    samples = next(s for s in history["series"] if s["name"] == name)["samples"]
    return samples[-1][3], samples[-1][1]


def test_the_history_is_the_servers_so_a_page_opened_later_sees_the_past(browser, page_server):
    first = page_server.request("GET", "/gpu/history")[2]
    oldest = min(s["samples"][0][0] for s in first["series"] if s["samples"])
    later = Watched(browser, page_server)
    try:
        held = later.page.evaluate("""() => Math.min(...[...state.history.values()]
            .filter((s) => s.samples.length).map((s) => s.samples[0][0]))""")
        assert held <= oldest + 1.0  # the new tab starts from the server's oldest sample, not from now
        assert later.problems == []
    finally:
        later.close()


def test_keyboard_reaches_every_control_and_the_file_input_behind_the_drop_zone(watched):
    page = watched.page
    reached = []
    for _ in range(12):
        page.keyboard.press("Tab")
        reached.append(page.evaluate("document.activeElement.id || document.activeElement.dataset.model || "
                                     "document.activeElement.tagName"))
    assert reached[:3] == ["model", "threshold", "file"]
    assert "faces" in reached and "window" in reached  # the Unload buttons and the chart's window
    for name in ("Model", "Window"):
        assert page.get_by_label(name, exact=True).count() == 1
    outline = page.evaluate("""() => { document.querySelector('#file').focus();
        return getComputedStyle(document.querySelector('.drop-label')).outlineStyle; }""")
    assert outline == "solid"  # the focus shows on the zone the hidden input sits behind
    assert watched.problems == []


def test_it_fits_a_phone(watched, astronaut):
    _, path = astronaut
    page = watched.page
    page.set_viewport_size({"width": 390, "height": 844})
    watched.detect("faces", path)
    time.sleep(0.3)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    box = page.locator("#photo").bounding_box()
    assert box["width"] <= 390
    page.screenshot(path=str(SHOTS / "phone.png"), full_page=True)
    assert watched.problems == []


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def test_on_a_gpu_host_the_panel_lists_every_process_by_model_with_cap_and_overhead(watched, page_server, tmp_path):
    # This host has no GPU, so /gpu is answered here by the real GpuReport over the NVML stand-in
    # (tests/fake_nvml.py behind app/gpu/nvml.py), its GPU 0 holding the page server's two real workers,
    # a process that is not ours, and a fleet of which this server is one instance.
    from fake_nvml import FakeNvml

    from app.fleet.state import FleetState, InstanceState, write_state
    from app.gpu.nvml import Nvml
    from app.gpu.report import GpuReport

    models = {m["name"]: m for m in page_server.request("GET", "/models")[2]["models"]}
    faces, shapes = models["faces"]["pid"], models["shapes"]["pid"]
    library = FakeNvml(faces)
    library.set_processes(0, (faces, 4596), (shapes, 2548), (4242, 4150))
    state = tmp_path / "fleet.json"
    write_state(state, FleetState(fleet_pid=99, gpu_overhead_mib=500, instances=(
        InstanceState(name="main", port=page_server.port, model="repository", gpu_memory="6GiB", caps_mib={0: 6144},
                      pid=page_server.process.pid, state="ready"),
        InstanceState(name="spare-detector", port=8123, model="faces", gpu_memory="4GiB", caps_mib={0: 4096},
                      pid=4242, state="ready"))))

    def worker(pid, name, cap):
        return {"pid": pid, "model": name, "version": "1", "caps_mib": {0: cap},
                "policy": {"mode": "cap", "spec": f"{cap}MiB", "gpus": [{"index": 0, "cap_mib": cap}], "note": None}}

    report = GpuReport(Nvml.open(library), workers=lambda: [worker(faces, "faces", 4096), worker(shapes, "shapes", 2048)],
                       pid=page_server.process.pid, fleet_state=state, instance_name="main").to_json()
    page = watched.page
    page.route("**/gpu", lambda route: route.fulfill(status=200, content_type="application/json",
                                                      body=json.dumps(report)))
    watched.polls_past(watched.polls_past(0))
    rows = page.locator('[data-gpu="0"] tbody tr')
    assert rows.count() == 3
    texts = [rows.nth(i).inner_text().split("\t") for i in range(3)]
    assert texts[0] == [str(faces), "worker: faces v1", "4596 MiB", "4096 MiB", "500 MiB"]
    assert texts[1] == [str(shapes), "worker: shapes v1", "2548 MiB", "2048 MiB", "500 MiB"]
    assert texts[2] == ["4242", "fleet instance spare-detector", "4150 MiB", "4096 MiB", "54 MiB"]
    assert "NVIDIA H200" in page.inner_text('[data-gpu="0"] h3')
    assert page.locator('[data-gpu="0"] .meter span').count() == 3
    assert page.locator('[data-gpu="1"] tbody tr').inner_text().startswith("777")
    assert f"HTTP process (pid {page_server.process.pid}) holds no GPU memory" in page.inner_text("#http-process")
    assert page.locator("#memory-note").is_hidden()  # caps are enforced here: no "not enforced" note
    link = page.locator("#fleet-list a")
    assert link.count() == 1 and link.get_attribute("href") == "http://127.0.0.1:8123/"
    assert "spare-detector" in link.inner_text()
    page.screenshot(path=str(SHOTS / "gpu-panel.png"), full_page=True)
    assert watched.problems == []
