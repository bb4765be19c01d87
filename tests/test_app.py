"""The Flask app with its collaborators in-process: readiness, and failures inside the model."""

from __future__ import annotations

import pytest

from app.state import ServingState

from images_for_tests import encode
from blob_model import blob_image

PNG = encode(blob_image(20, 20, {1: (2, 2, 6, 6)}))


def test_not_ready_until_a_detector_is_published(app_factory, detector):
    state = ServingState()
    client = app_factory(state=state).test_client()
    response = client.get("/readyz")
    assert response.status_code == 503 and response.json["error"]["code"] == "not_ready"
    response = client.post("/detect", data=PNG, content_type="image/png")
    assert response.status_code == 503 and "not loaded yet" in response.json["error"]["message"]
    assert client.get("/healthz").status_code == 200
    state.set_detector(detector)
    assert client.get("/readyz").status_code == 200
    assert client.post("/detect", data=PNG, content_type="image/png").status_code == 200


def test_draining_turns_readiness_to_503_but_accepted_requests_are_served(app_factory):
    app = app_factory()
    client = app.test_client()
    app.extensions["detect"].state.start_draining()
    response = client.get("/readyz")
    assert response.status_code == 503 and "shutting down" in response.json["error"]["message"]
    assert client.post("/detect", data=PNG, content_type="image/png").status_code == 200


class _Exploding:
    name, version = "boom", "1"

    def __init__(self, detector):
        self._detector = detector

    def detect(self, images, threshold, max_detections, deadline=None):
        if images[0].shape[1] == 13:
            raise ValueError("the model cannot take 13 columns")
        return self._detector.detect(images, threshold, max_detections)


def test_a_model_that_raises_fails_that_request_alone(app_factory, detector, caplog):
    client = app_factory(state=ServingState(_Exploding(detector))).test_client()
    response = client.post("/detect", data=encode(blob_image(13, 10, {})), content_type="image/png")
    assert response.status_code == 500
    assert response.json["error"] == {"code": "inference_failed",
                                      "message": "the model failed on this request: ValueError"}
    assert "the model cannot take 13 columns" in caplog.text  # the cause is logged, not sent
    assert client.post("/detect", data=PNG, content_type="image/png").status_code == 200


@pytest.mark.parametrize("route", ["/detect", "/gpu", "/healthz", "/readyz", "/metrics"])
def test_every_route_answers_json_or_prometheus_text(client, route):
    response = client.post(route, data=PNG, content_type="image/png") if route == "/detect" else client.get(route)
    assert response.status_code == 200
    assert response.mimetype == ("text/plain" if route == "/metrics" else "application/json")
