"""Answers drawn on the image: POST /detect with format=jpeg or png, or an Accept header that prefers them.

On the session's real server (the blob model: exact boxes), and on app/vision/annotate.py itself: the boxes are
where the JSON says, in their class's colour, on the image upright, at its size or at max_side; the JSON
answer travels in the Detections header.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from PIL import Image

from app.http.detect import detections_header
from app.inference.detections import Box, Detection
from app.vision.annotate import PALETTE, colour_of, draw_detections, encode_picture
from blob_model import blob_image
from conftest import ROOT
from images_for_tests import ORIENT, encode

RED_GREEN = blob_image(120, 90, {1: (10, 20, 40, 50), 2: (70, 30, 110, 80)})


def post(server, body: bytes, path: str = "/detect", headers: dict | None = None):
    return server.request("POST", path, body, {"Content-Type": "image/png", **(headers or {})})


def picture_of(body: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(body)).convert("RGB")).astype(int)


def near(pixel, colour, tolerance: int = 40) -> bool:
    return int(np.abs(np.asarray(pixel) - np.asarray(colour)).sum()) <= tolerance


@pytest.mark.parametrize("ask, kind", [
    ({"path": "/detect?format=jpeg"}, "image/jpeg"),
    ({"path": "/detect?format=png"}, "image/png"),
    ({"headers": {"Accept": "image/jpeg"}}, "image/jpeg"),
    ({"headers": {"Accept": "image/png, application/json;q=0.5"}}, "image/png"),
    ({"headers": {"Accept": "image/*"}}, "image/jpeg"),
])
def test_an_annotated_answer_is_the_picture_with_the_json_answer_in_its_header(server, ask, kind):
    status, headers, body = post(server, encode(RED_GREEN), **ask)
    assert status == 200 and headers["Content-Type"] == kind
    assert "Accept" in headers["Vary"]
    document = json.loads(headers["Detections"])
    _, _, plain = post(server, encode(RED_GREEN))
    assert document["detections"] == plain["detections"]  # the same answer as JSON
    assert (document["width"], document["height"]) == (120, 90) and document["model"]["name"] == "blob"
    assert "draw" in document["timing_ms"]
    picture = picture_of(body)
    assert picture.shape == (90, 120, 3)
    # each box's outline in its class's colour, on the blob's edge; the blob inside is left as it was
    slack = 40 if kind == "image/png" else 90  # JPEG blurs a 2-pixel line's colour
    assert near(picture[35, 10], colour_of(1), slack) and near(picture[55, 70], colour_of(2), slack)
    assert near(picture[35, 25], (255, 0, 0), slack)


@pytest.mark.parametrize("accept", [None, "*/*", "application/json", "text/html,*/*;q=0.8", "image/webp"])
def test_json_stays_the_answer_unless_a_picture_is_asked_for(server, accept):
    status, headers, answer = post(server, encode(RED_GREEN), headers={"Accept": accept} if accept else {})
    assert status == 200 and headers["Content-Type"] == "application/json" and "detections" in answer
    assert "Detections" not in headers


def test_max_side_makes_the_picture_smaller_and_the_boxes_follow(server):
    status, headers, body = post(server, encode(blob_image(400, 300, {1: (100, 60, 200, 160)})),
                                 "/detect?format=png&max_side=200")
    assert status == 200
    picture = picture_of(body)
    assert picture.shape == (150, 200, 3)
    document = json.loads(headers["Detections"])
    assert (document["width"], document["height"]) == (400, 300)  # the answer stays in the image's own pixels
    assert document["detections"][0]["box"] == {"x_min": 100.0, "y_min": 60.0, "x_max": 200.0, "y_max": 160.0}
    assert near(picture[55, 50], colour_of(1))  # the box at half scale: its left edge at x 50
    assert near(picture[55, 75], (255, 0, 0), 60)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_the_picture_is_upright_as_the_user_sees_it(server, orientation):
    stored = blob_image(60, 40, {1: (5, 10, 15, 20)})
    data = encode(stored, "JPEG", orientation=orientation, quality=100, subsampling=0)
    status, headers, body = server.request("POST", "/detect?format=png", data, {"Content-Type": "image/jpeg"})
    assert status == 200
    seen = ORIENT[orientation](stored)
    picture = picture_of(body)
    assert picture.shape == seen.shape
    ys, xs = np.nonzero(seen[..., 0] > 200)
    box = json.loads(headers["Detections"])["detections"][0]["box"]
    assert (box["x_min"], box["y_min"]) == pytest.approx((xs.min(), ys.min()), abs=1.0)
    assert near(picture[int(ys.max()), int(xs.mean())], colour_of(1), 80)  # the box's bottom edge


@pytest.mark.parametrize("path, body, fragment", [
    ("/detect?format=gif", None, "format must be json, jpeg or png"),
    ("/detect?format=png&max_side=8", None, "max_side must be a whole number from 16 to 8192"),
    ("/detect?format=png&max_side=1e3", None, "max_side must be a whole number"),
    ("/detect?max_side=100", None, "max_side sizes the picture"),
    ("/detect?format=jpeg", b'{"images": ["%s"]}', "takes one image; this request has 1 as a list"),
])
def test_bad_picture_requests_are_400_naming_why(server, path, body, fragment):
    import base64

    if body is None:
        data, kind = encode(RED_GREEN), "image/png"
    else:
        data, kind = body.replace(b"%s", base64.b64encode(encode(RED_GREEN))), "application/json"
    status, _, answer = server.request("POST", path, data, {"Content-Type": kind})
    assert status == 400 and fragment in answer["error"]["message"], answer


def test_the_detections_header_keeps_to_its_budget_with_the_surest_first():
    detections = [{"label": "thing", "class_id": 1, "score": round(1 - i / 1000, 4),
                   "box": {"x_min": 1.5, "y_min": 2.5, "x_max": 100.5, "y_max": 200.5}} for i in range(500)]
    document = {"model": {"name": "m", "version": "1"}, "width": 640, "height": 480, "detections": detections,
                "timing_ms": {"total": 1.0}}
    header = detections_header(document, limit=4096)
    assert len(header) <= 4096 and header.isascii()
    cut = json.loads(header)
    kept = len(cut["detections"])
    assert 0 < kept < 500 and cut["detections"] == detections[:kept]
    assert cut["detections_omitted"] == 500 - kept
    one_more = {**document, "detections": detections[:kept + 1], "detections_omitted": 500 - kept - 1}
    assert len(json.dumps(one_more, separators=(",", ":"))) > 4096  # as many as fit, not fewer
    small = {**document, "detections": detections[:3]}
    assert json.loads(detections_header(small, limit=4096)) == small  # whole, and no detections_omitted


def test_the_page_draws_with_the_same_class_colours_as_the_server():
    page = (ROOT / "app" / "http" / "static" / "page.js").read_text()
    block = re.search(r"const CLASS_COLOURS = \[(.*?)\];", page, re.S).group(1)
    assert tuple(re.findall(r'"(#[0-9a-f]{6})"', block)) == PALETTE


def test_colours_are_stable_per_class_and_labels_grow_with_the_picture():
    assert colour_of(1) == (0x1F, 0x77, 0xB4) and colour_of(21) == colour_of(1) and colour_of(2) != colour_of(1)
    small, large = Image.new("RGB", (160, 120), "white"), Image.new("RGB", (1600, 1200), "white")
    draw_detections(small, [Detection("person", 1, 0.93, Box(10, 40, 60, 100))])
    draw_detections(large, [Detection("person", 1, 0.93, Box(100, 400, 600, 1000))], track_ids=[7])

    def tag_rows(picture, top):  # rows above the box holding its label's tag
        above = np.asarray(picture)[:top].astype(int)
        return int(((np.abs(above - colour_of(1)).sum(axis=2) < 30).any(axis=1)).sum())

    assert tag_rows(large, 400) > 2 * tag_rows(small, 40) > 0  # 33 px letters against the 11 px least
    assert encode_picture(small, "jpeg")[:3] == b"\xff\xd8\xff" and encode_picture(small, "png")[:4] == b"\x89PNG"
