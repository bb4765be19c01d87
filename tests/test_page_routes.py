"""What the page stands on, without a browser: its routes, the memory history ring, the
Content-Security-Policy on every answer, and CORS only for the origins an operator lists."""

from __future__ import annotations

import pytest

from app.errors import ConfigError
from app.http.headers import CONTENT_SECURITY_POLICY
from app.models.history import MemoryHistory, sample_memory
from app.settings import load_settings


def test_the_ring_keeps_the_last_keep_s_of_samples_per_series_and_answers_since():
    history = MemoryHistory(interval_s=1.0, keep_s=5.0)
    for t in range(8):
        history.record(1000.0 + t, [("model", "faces", 100.0 + t, "rss", "ready"), ("server", "server", 50.0, "rss",
                                                                                    "running")])
    answer = history.to_json()
    faces = next(s for s in answer["series"] if s["name"] == "faces")
    assert [s[0] for s in faces["samples"]] == [1003.0, 1004.0, 1005.0, 1006.0, 1007.0]  # five, the oldest gone
    assert faces["samples"][-1] == [1007.0, 107.0, "rss", "ready"]
    assert answer["fields"] == ["unix", "used_mib", "source", "state"] and answer["keep_s"] == 5.0
    assert [s["kind"] for s in answer["series"]] == ["model", "server"]  # models first
    newer = history.to_json(since=1005.0)
    assert [s[0] for s in next(s for s in newer["series"] if s["name"] == "faces")["samples"]] == [1006.0, 1007.0]


def test_a_sample_is_due_once_per_interval():
    history = MemoryHistory(interval_s=1.0)
    assert history.due(10.0) and not history.due(10.5) and history.due(11.0)


def test_the_registry_samples_each_model_its_workers_and_the_http_process(blob_registry):
    rows = {(kind, name): (used, source, state) for kind, name, used, source, state in sample_memory(blob_registry)}
    (model,) = [key for key in rows if key[0] == "model"]
    used, source, state = rows[model]
    assert state == "ready" and source == "rss" and used > 100  # a worker with TensorFlow in it
    assert rows[("server", "server")][0] > 10 and rows[("server", "server")][1] == "rss"
    assert ("spares", "spares") in rows


def test_gpu_history_answers_json_and_refuses_bad_parameters(client):
    answer = client.get("/gpu/history")
    assert answer.status_code == 200 and answer.get_json()["interval_s"] == 1.0
    assert client.get("/gpu/history?since=1e9").status_code == 200
    for query, words in (("since=yesterday", "unix time"), ("since=nan", "unix time"), ("window=5", "since")):
        refused = client.get(f"/gpu/history?{query}")
        assert refused.status_code == 400 and words in refused.get_json()["error"]["message"], query


def test_models_names_the_default_model_for_the_page(client, blob_registry):
    assert client.get("/models").get_json()["default_model"] == blob_registry.default().name


def test_every_answer_carries_the_policy_and_no_cors_by_default(client):
    for path in ("/", "/models", "/nowhere", "/static/page.css"):
        with client.get(path) as answer:  # closes the page's file
            assert answer.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
            assert answer.headers["X-Content-Type-Options"] == "nosniff"
            assert "Access-Control-Allow-Origin" not in answer.headers
    preflight = client.options("/models/x/detect", headers={"Origin": "https://app.example",
                                                            "Access-Control-Request-Method": "POST"})
    assert "Access-Control-Allow-Origin" not in preflight.headers


def test_listed_origins_and_only_they_may_call_the_api(app_factory):
    client = app_factory(cors_origins=("https://app.example", "http://localhost:3000")).test_client()
    asked = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "Content-Type, X-Evil"}
    preflight = client.options("/models/x/detect", headers=asked)
    assert preflight.status_code == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert preflight.headers["Access-Control-Allow-Headers"] == "content-type"  # nothing it did not need
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    answer = client.get("/models", headers={"Origin": "http://localhost:3000"})
    assert answer.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "Origin" in answer.headers["Vary"]
    stranger = client.get("/models", headers={"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in stranger.headers and "Origin" in stranger.headers["Vary"]


@pytest.mark.parametrize("raw, parsed", [
    ("", ()),
    ("https://App.Example/", ("https://app.example",)),
    ("https://app.example:443, http://localhost:3000", ("https://app.example", "http://localhost:3000")),
    ("http://[::1]:8080", ("http://[::1]:8080",)),
])
def test_cors_origins_are_read_as_browsers_write_them(raw, parsed, tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert load_settings(config_path=empty, environ={"DETECT_CORS_ORIGINS": raw}).cors_origins == parsed


@pytest.mark.parametrize("raw", ["*", "app.example", "https://app.example/path", "ftp://x.example", "http://x:99999"])
def test_cors_origins_refuse_wildcards_paths_and_other_schemes(raw, tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="origins"):
        load_settings(config_path=empty, environ={"DETECT_CORS_ORIGINS": raw})
