"""Every recorded HTTP and gRPC exchange (tests/exchanges.json) answered by this code exactly as it was recorded,
and every HTTP route and gRPC method covered by at least one; tests/exchanges.py records and explains them."""

from __future__ import annotations

import difflib
import json

import pytest

from exchanges import RECORDED, GrpcPort, answer, prepare_shared_memory

SHOWN_MISMATCHES = 5  # diffs printed in full; the rest are named


@pytest.fixture(scope="module")
def recording() -> dict:
    return json.loads(RECORDED.read_text())


@pytest.fixture(scope="module")
def replay(blob_model_dir, tmp_path_factory, recording):
    """One server of this code, on the blob model and the settings the exchanges were recorded with."""
    from conftest import start_server

    server = start_server({"DETECT_MODEL": str(blob_model_dir), **recording["server_env"]},
                          tmp_path_factory.mktemp("exchanges") / "server.log")
    prepare_shared_memory()
    port = GrpcPort(server.grpc_port)
    yield server, port, str(blob_model_dir)
    port.close()
    server.stop()


def _text(value) -> list[str]:
    return json.dumps(value, indent=1, ensure_ascii=False).splitlines()


def test_every_exchange_is_answered_as_recorded(replay, recording):
    """Sent in the recorded order (the model is unloaded and loaded again on the way), each answer equals the
    recorded one after the same normalization, key order and JSON layout included."""
    server, port, model_base = replay
    mismatches = []
    for exchange in recording["exchanges"]:
        got = answer(exchange, server.port, port, model_base)
        if _text(got) != _text(exchange["answer"]):
            mismatches.append((exchange, got))
    report = [f"{len(mismatches)} of {len(recording['exchanges'])} exchanges answered otherwise than recorded: "
              + ", ".join(repr(e["name"]) for e, _ in mismatches)]
    for exchange, got in mismatches[:SHOWN_MISMATCHES]:
        diff = difflib.unified_diff(_text(exchange["answer"]), _text(got), "recorded", "answered", lineterm="", n=2)
        report += [f"\n--- {exchange['name']} ({exchange['protocol']}: "
                   f"{exchange['request'].get('method')} {exchange['request'].get('path', '')})", *list(diff)[:60]]
    if mismatches:
        pytest.fail("\n".join(report), pytrace=False)


def test_every_http_route_and_method_has_a_successful_exchange(recording):
    """A route added to the app without an exchange recorded for it fails here (HEAD and OPTIONS are Flask's own)."""
    from werkzeug.exceptions import HTTPException

    from app.http.app import create_app
    from app.protocol.plane import DataPlane
    from app.settings import Settings

    url_map = create_app(DataPlane(Settings(), models=None, gpu=None, metrics=None)).url_map
    adapter = url_map.bind("127.0.0.1")
    answered: dict[tuple[str, str], list[int]] = {}
    for exchange in recording["exchanges"]:
        request = exchange["request"]
        if exchange["protocol"] != "http":
            continue
        try:
            rule, _ = adapter.match(request["path"].split("?")[0], request["method"], return_rule=True)
        except HTTPException:
            continue  # the exchanges of no route and of a method not allowed
        answered.setdefault((rule.rule, request["method"]), []).append(exchange["answer"]["status"])
    routes = {(rule.rule, method) for rule in url_map.iter_rules() for method in rule.methods - {"HEAD", "OPTIONS"}}
    assert routes, "the app has routes"
    missing = sorted(routes - set(answered))
    assert not missing, f"routes with no recorded exchange: {missing}"
    # An extension the server lacks has routes that only ever refuse (app/http/v2.py's UNIMPLEMENTED_EXTENSIONS).
    refusing = {rule.rule for rule in url_map.iter_rules() if rule.endpoint.startswith("v2.unimplemented ")}
    unsuccessful = sorted(route for route in routes if route[0] not in refusing
                          and not any(200 <= s < 300 for s in answered[route]))
    assert all(answered[route] == [400] for route in routes if route[0] in refusing)
    assert not unsuccessful, f"routes with no successful exchange recorded: {unsuccessful}"


def test_every_grpc_method_on_the_port_has_an_exchange(replay, recording):
    """Every method of every service the gRPC port serves (its reflection service lists them) is called."""
    _, port, _ = replay
    methods = port.methods()
    assert len(port.services) >= 5 and "/inference.GRPCInferenceService/ModelInfer" in methods
    called = {e["request"]["method"] for e in recording["exchanges"] if e["protocol"] == "grpc"}
    missing = sorted(set(methods) - called)
    assert not missing, f"gRPC methods with no recorded exchange: {missing}"
