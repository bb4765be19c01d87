"""The field's own tools, unmodified, against a real server on the blob model: Triton's perf_analyzer 2.60 (Triton
mode over HTTP and gRPC, streaming, system shared memory; TF Serving mode) and KServe's Python SDK 0.21 (its REST
and gRPC clients). tools/clients.py sets them up, once per machine."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from blob_model import blob_image
from tools.clients import debian_mirror, run_kserve_client
from images_for_tests import encode

RED_GREEN = blob_image(64, 48, {1: (10, 5, 20, 15), 2: (30, 20, 50, 40)})
BLUE = blob_image(32, 32, {3: (4, 4, 12, 12)})
RED_BOX = [5 / 48, 10 / 64, 15 / 48, 20 / 64]
GREEN_BOX = [20 / 48, 30 / 64, 40 / 48, 50 / 64]
OUTPUTS = ("detection_boxes", "detection_classes", "detection_scores", "num_detections")
REQUESTS = 40  # per perf_analyzer run: one measurement of this many requests, a second or two on the blob model
PERF_ANALYZER_TIMEOUT_S = 45.0


# perf_analyzer ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def red_green_data(tmp_path_factory) -> Path:
    """perf_analyzer's --input-data file: the red and green blobs' pixels as the one input, batch dimension left out."""
    path = tmp_path_factory.mktemp("perf_analyzer") / "red_green.json"
    path.write_text(json.dumps({"data": [{"input_tensor": {"content": RED_GREEN.ravel().tolist(),
                                                           "shape": list(RED_GREEN.shape)}}]}))
    return path


def run_perf_analyzer(perf_analyzer: list[str], tmp_path: Path, *args: str) -> tuple[dict, str]:
    """Run perf_analyzer at concurrency 1 for REQUESTS requests; return its CSV report's row and its printed report.

    A count of requests, not time windows: on a busy CI machine the windows may never agree within perf_analyzer's
    stability bound, and the run would end in "Failed to obtain stable measurement" rather than in a report.
    """
    report = tmp_path / "report.csv"
    argv = [*perf_analyzer, "-m", "blob", "--concurrency-range", "1", "--request-count", str(REQUESTS),
            "-f", str(report), *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PERF_ANALYZER_TIMEOUT_S)
    except subprocess.TimeoutExpired as stuck:  # its output comes as bytes here, whatever `text` says
        printed = b"".join(part or b"" for part in (stuck.stdout, stuck.stderr)).decode(errors="replace")
        pytest.fail(f"perf_analyzer did not finish in {PERF_ANALYZER_TIMEOUT_S:.0f} s:\n{printed}")
    printed = done.stdout + done.stderr
    if done.returncode != 0:
        pytest.fail(f"perf_analyzer exited {done.returncode}:\n{printed}")
    with report.open() as handle:
        (row,) = list(csv.DictReader(handle))
    return row, printed


def assert_measured(row: dict, printed: str) -> None:
    """The report holds a throughput and latencies for concurrency 1, and every request succeeded."""
    assert row["Concurrency"] == "1"
    assert float(row["Inferences/Second"]) > 0, row
    assert 0 < int(row["p50 latency"]) <= int(row["p99 latency"]), row
    assert f"Request count: {REQUESTS}" in printed, printed


def assert_server_split(row: dict, printed: str) -> None:
    """perf_analyzer read the server's statistics: its report splits the server's time by stage."""
    for column in ("Server Queue", "Server Compute Input", "Server Compute Infer", "Server Compute Output"):
        assert column in row, f"no {column!r} in the report: {sorted(row)}"
    assert int(row["Server Compute Infer"]) > 0, row
    assert "Server: " in printed and "Inference count: " in printed, printed


def test_the_private_apt_configuration_uses_this_machines_debian_mirror(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "deb http://security.debian.org/debian-security bookworm-security main\n"
        "deb [arch=amd64] http://mirror.example/debian/ bookworm main  # the archive\n")
    assert debian_mirror(tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list").unlink()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://deb.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://deb.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n")
    assert debian_mirror(tmp_path) == "http://deb.example/debian"
    assert debian_mirror(tmp_path / "nothing") == "http://deb.debian.org/debian"


def test_perf_analyzer_runs_at_all(perf_analyzer):
    done = subprocess.run([*perf_analyzer, "--version"], capture_output=True, text=True, timeout=30)
    assert "Perf Analyzer Version 2.60" in done.stdout + done.stderr, done


def test_perf_analyzer_tf_serving_mode_over_grpc(perf_analyzer, server, tmp_path):
    row, printed = run_perf_analyzer(
        perf_analyzer, tmp_path, "--service-kind", "tfserving", "-i", "grpc", "-u", f"127.0.0.1:{server.grpc_port}",
        "--shape", "input_tensor:1,48,64,3")
    assert "Service Kind: TENSORFLOW_SERVING" in printed, printed
    assert_measured(row, printed)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_triton_mode(perf_analyzer, server, tmp_path, red_green_data, protocol):
    port = server.port if protocol == "http" else server.grpc_port
    row, printed = run_perf_analyzer(perf_analyzer, tmp_path, "-i", protocol, "-u", f"127.0.0.1:{port}",
                                     "--input-data", str(red_green_data))
    assert "Service Kind: TRITON" in printed, printed
    assert_measured(row, printed)
    assert_server_split(row, printed)


def test_perf_analyzer_triton_mode_streaming_over_grpc(perf_analyzer, server, tmp_path, red_green_data):
    row, printed = run_perf_analyzer(perf_analyzer, tmp_path, "-i", "grpc", "--streaming",
                                     "-u", f"127.0.0.1:{server.grpc_port}", "--input-data", str(red_green_data))
    assert_measured(row, printed)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_triton_mode_with_system_shared_memory(perf_analyzer, server, tmp_path, red_green_data,
                                                             protocol):
    port = server.port if protocol == "http" else server.grpc_port
    row, printed = run_perf_analyzer(perf_analyzer, tmp_path, "-i", protocol, "-u", f"127.0.0.1:{port}",
                                     "--shared-memory", "system", "--input-data", str(red_green_data))
    assert_measured(row, printed)


# KServe's Python SDK ------------------------------------------------------------------------------------------

# Each snippet runs inside the SDK's own venv (tools/clients.py, run_kserve_client): the SDK's classes, unmodified.
HEALTH = """
{client}
async with client:
    answer = {{"live": await client.is_server_live({base}), "ready": await client.is_server_ready({base}),
              "model_ready": await client.is_model_ready({base}"blob")}}
    try:
        answer["unknown_model"] = {{"ready": await client.is_model_ready({base}"nope")}}
    except Exception as refused:  # the gRPC client raises the call's status
        answer["unknown_model"] = {{"error": refused.code().name}}
emit(answer)
"""

# How each of the SDK's clients is made, what its calls take before their own arguments (the REST client: the URL),
# and how its infer names the model beyond the request (the REST client: model_name).
CLIENTS = {
    "rest": {"client": "client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol='v2', timeout=30, retries=0))",
             "base": "URL, ", "model_name": ", model_name='blob'"},
    "grpc": {"client": "client = kserve.InferenceGRPCClient(URL, timeout=30, retries=0)", "base": "",
             "model_name": ""},
}

INFER = """
from kserve.protocol.infer_type import RequestedOutput
pixels = kserve.InferInput("input_tensor", list(ARRAYS["pixels"].shape), "UINT8")
pixels.set_data_from_numpy(ARRAYS["pixels"], binary_data={binary})
outputs = [RequestedOutput(name, {{"binary_data": {binary}}}) for name in {outputs}]
request = kserve.InferRequest("blob", [pixels], request_id="kserve-sdk", request_outputs=outputs)
{client}
async with client:
    response = await client.infer({base}request{model_name})
emit({{"id": response.id, "model_name": response.model_name, "model_version": response.model_version,
       "outputs": {{o.name: o.as_numpy().tolist() for o in response.outputs}}}})
"""

FILES = """
from kserve.protocol.infer_type import RequestedOutput
files = kserve.InferInput("image", [2], "BYTES")
files.set_data_from_numpy(np.array([ARRAYS["red_green"].tobytes(), ARRAYS["blue"].tobytes()], dtype=object),
                          binary_data=True)
outputs = [RequestedOutput("num_detections"), RequestedOutput("detections")]
request = kserve.InferRequest("blob", [files], request_outputs=outputs, parameters={{"threshold": {threshold}}})
{client}
async with client:
    response = await client.infer({base}request{model_name})
answer = {{o.name: o.as_numpy().tolist() for o in response.outputs}}
emit({{"num_detections": answer["num_detections"],
       "detections": [json.loads(d) for d in answer["detections"]]}})
"""


def kserve_url(server, transport: str) -> str:
    return f"http://127.0.0.1:{server.port}" if transport == "rest" else f"127.0.0.1:{server.grpc_port}"


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_kserve_sdk_health_and_model_readiness(kserve_python, server, transport):
    answer = run_kserve_client(kserve_python, HEALTH.format(**CLIENTS[transport]), kserve_url(server, transport))
    unknown = {"ready": False} if transport == "rest" else {"error": "NOT_FOUND"}  # as each client reports it
    assert answer == {"live": True, "ready": True, "model_ready": True, "unknown_model": unknown}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_kserve_sdk_infer_on_pixels(kserve_python, server, transport, binary):
    code = INFER.format(binary=binary, outputs=OUTPUTS, **CLIENTS[transport])
    answer = run_kserve_client(kserve_python, code, kserve_url(server, transport), {"pixels": RED_GREEN[None]})
    assert answer["id"] == "kserve-sdk" and answer["model_name"] == "blob"
    # The REST client's InferResponse.from_bytes leaves the served version out; the gRPC client keeps it.
    assert answer["model_version"] == (None if transport == "rest" else "2")
    outputs = answer["outputs"]
    assert outputs["num_detections"] == [2.0]
    np.testing.assert_allclose(np.array(outputs["detection_boxes"])[0, :2], [RED_BOX, GREEN_BOX], atol=1e-6)
    assert outputs["detection_classes"][0][:2] == [1.0, 2.0]
    np.testing.assert_allclose(outputs["detection_scores"][0][:2], [0.9, 0.6], atol=1e-6)


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_kserve_sdk_infer_on_encoded_files_with_a_threshold(kserve_python, server, transport):
    """The threshold as the SDK can send it: a float over REST; over gRPC a string, since its parameters hold none."""
    threshold = "0.5" if transport == "rest" else "'0.5'"
    code = FILES.format(threshold=threshold, **CLIENTS[transport])
    files = {"red_green": np.frombuffer(encode(RED_GREEN), np.uint8),
             "blue": np.frombuffer(encode(BLUE, "JPEG", quality=95), np.uint8)}
    answer = run_kserve_client(kserve_python, code, kserve_url(server, transport), files)
    assert answer["num_detections"] == [2.0, 1.0]
    assert [(d["class_id"], d["box"]) for d in answer["detections"][0]["detections"]] == \
        [(1, {"x_min": 10.0, "y_min": 5.0, "x_max": 20.0, "y_max": 15.0}),
         (2, {"x_min": 30.0, "y_min": 20.0, "x_max": 50.0, "y_max": 40.0})]
    assert answer["detections"][1]["detections"] == []  # blue scores 0.3, under the threshold
