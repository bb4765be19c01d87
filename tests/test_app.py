"""The Flask app over a real model registry: readiness, draining, and failures inside the model."""

from __future__ import annotations

import pytest

from app.hosting.lifecycle import Lifecycle

from blob_model import blob_image, build_blob_model
from conftest import running_registry
from images_for_tests import encode

PNG = encode(blob_image(20, 20, {1: (2, 2, 6, 6)}))


def test_not_ready_until_the_preloaded_model_has_loaded_and_a_request_meanwhile_waits_for_it(app_factory,
                                                                                             blob_model_dir):
    with running_registry(blob_model_dir, spare_workers=0, wait=False) as registry:
        client = app_factory(models=registry).test_client()
        response = client.get("/readyz")  # its worker is still importing TensorFlow, seconds of work
        assert response.status_code == 503 and response.json["error"]["code"] == "not_ready"
        assert client.get("/healthz").status_code == 200
        answer = client.post("/detect", data=PNG, content_type="image/png")
        assert answer.status_code == 200 and answer.json["timing_ms"]["load"] > 0
        assert [d["class_id"] for d in answer.json["detections"]] == [1]
        assert client.get("/readyz").status_code == 200


def test_a_model_not_preloaded_is_ready_unloaded_and_its_first_request_loads_it(app_factory, blob_model_dir):
    with running_registry(blob_model_dir, preload=False, spare_workers=0) as registry:
        client = app_factory(models=registry).test_client()
        assert client.get("/readyz").status_code == 200
        assert registry.get("blob").state == "unloaded" and registry.get("blob").worker is None
        answer = client.post("/detect", data=PNG, content_type="image/png")
        assert answer.status_code == 200 and answer.json["timing_ms"]["load"] > 0
        again = client.post("/detect", data=PNG, content_type="image/png")
        assert again.status_code == 200 and "load" not in again.json["timing_ms"]


def test_draining_turns_readiness_to_503_but_accepted_requests_are_served(app_factory):
    lifecycle = Lifecycle()
    client = app_factory(lifecycle=lifecycle).test_client()
    assert client.get("/readyz").status_code == 200
    lifecycle.begin_draining()
    response = client.get("/readyz")
    assert response.status_code == 503 and "shutting down" in response.json["error"]["message"]
    assert client.post("/detect", data=PNG, content_type="image/png").status_code == 200


def test_a_model_that_raises_fails_that_request_alone(app_factory, tmp_path, caplog):
    fragile = build_blob_model(tmp_path / "fragile" / "1", fail_on_width=13)
    with running_registry(fragile.parent, spare_workers=0) as registry:
        client = app_factory(models=registry).test_client()
        response = client.post("/detect", data=encode(blob_image(13, 10, {})), content_type="image/png")
        assert response.status_code == 500
        assert response.json["error"] == {"code": "inference_failed",
                                          "message": "the model failed on this image: InvalidArgumentError"}
        assert client.post("/detect", data=PNG, content_type="image/png").status_code == 200
        assert registry.get("fragile").worker.alive  # the worker survived its model's failure


@pytest.mark.parametrize("route", ["/detect", "/models/blob/detect", "/gpu", "/healthz", "/readyz", "/metrics",
                                   "/models", "/models/blob"])
def test_every_route_answers_json_or_prometheus_text(client, route):
    response = client.post(route, data=PNG, content_type="image/png") if route.endswith("detect") else client.get(route)
    assert response.status_code == 200
    assert response.mimetype == ("text/plain" if route == "/metrics" else "application/json")
