"""KServe v2 (driven by the real tritonclient.http) and TF Serving's REST API, against a real server on the blob
model, whose answers are known exactly; and the OpenAPI description, validated and fuzzed against the server."""

from __future__ import annotations

import base64
import gzip
import json
import time

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from blob_model import blob_image
from images_for_tests import encode

RED_GREEN = blob_image(64, 48, {1: (10, 5, 20, 15), 2: (30, 20, 50, 40)})
BLUE = blob_image(32, 32, {3: (4, 4, 12, 12)})
# The blob model's boxes, normalized [ymin, xmin, ymax, xmax], as the model gives them.
RED_BOX = [5 / 48, 10 / 64, 15 / 48, 20 / 64]
GREEN_BOX = [20 / 48, 30 / 64, 40 / 48, 50 / 64]


@pytest.fixture(scope="module")
def client(server):
    with_client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
    yield with_client
    with_client.close()


def pixels_input(array: np.ndarray, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("input_tensor", list(array.shape), "UINT8")
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def files_input(files: list[bytes]) -> triton.InferInput:
    tensor = triton.InferInput("image", [len(files)], "BYTES")
    tensor.set_data_from_numpy(np.array(files, dtype=object), binary_data=True)
    return tensor


# KServe v2 ----------------------------------------------------------------------------------------------------

def test_server_metadata_health_and_readiness(client):
    metadata = client.get_server_metadata()
    assert {"binary_tensor_data", "model_configuration", "model_repository"} <= set(metadata["extensions"])
    assert metadata["name"] and metadata["version"]
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("blob") and client.is_model_ready("blob", "2")
    assert not client.is_model_ready("blob", "1")  # on disk, not the version served


def test_model_metadata_is_the_signature_with_variable_dimensions_as_minus_one(client):
    metadata = client.get_model_metadata("blob")
    assert metadata["name"] == "blob" and metadata["platform"] == "tensorflow_savedmodel"
    assert metadata["versions"] == ["2"]
    assert metadata["inputs"] == [{"name": "input_tensor", "datatype": "UINT8", "shape": [-1, -1, -1, 3]}]
    outputs = {o["name"]: (o["datatype"], o["shape"]) for o in metadata["outputs"]}
    assert outputs["detection_boxes"][0] == "FP32" and outputs["detection_boxes"][1][-1] == 4
    assert set(outputs) >= {"detection_boxes", "detection_classes", "detection_scores", "num_detections"}
    assert client.get_model_metadata("blob", "2") == metadata


@pytest.mark.parametrize("binary", [True, False])
def test_infer_on_the_models_own_image_tensor(client, binary):
    batch = np.stack([RED_GREEN, RED_GREEN[::-1]])  # the second upside down
    outputs = [triton.InferRequestedOutput(name, binary_data=binary)
               for name in ("detection_boxes", "detection_classes", "detection_scores", "num_detections")]
    result = client.infer("blob", [pixels_input(batch, binary)], outputs=outputs)
    count = result.as_numpy("num_detections")
    assert count.dtype == np.float32 and count.tolist() == [2.0, 2.0]
    boxes, classes, scores = (result.as_numpy(n) for n in ("detection_boxes", "detection_classes",
                                                            "detection_scores"))
    assert boxes.shape[0] == 2 and boxes.shape[2] == 4 and classes.shape == scores.shape == boxes.shape[:2]
    np.testing.assert_allclose(boxes[0, :2], [RED_BOX, GREEN_BOX], atol=1e-6)
    np.testing.assert_allclose(boxes[1, 0], [1 - RED_BOX[2], RED_BOX[1], 1 - RED_BOX[0], RED_BOX[3]], atol=1e-6)
    assert classes[0, :2].tolist() == [1.0, 2.0]
    np.testing.assert_allclose(scores[0, :2], [0.9, 0.6], atol=1e-6)
    assert result.get_response()["model_version"] == "2"


def test_infer_on_encoded_files_decodes_as_detect_does_and_answers_detections_json(client, server):
    files = [encode(RED_GREEN), encode(BLUE, "JPEG", quality=95)]
    outputs = [triton.InferRequestedOutput("num_detections"), triton.InferRequestedOutput("detections")]
    result = client.infer("blob", [files_input(files)], outputs=outputs, parameters={"threshold": 0.5})
    assert result.as_numpy("num_detections").tolist() == [2.0, 1.0]
    answers = [json.loads(item) for item in result.as_numpy("detections")]
    assert [(d["class_id"], d["box"]) for d in answers[0]["detections"]] == \
        [(1, {"x_min": 10.0, "y_min": 5.0, "x_max": 20.0, "y_max": 15.0}),
         (2, {"x_min": 30.0, "y_min": 20.0, "x_max": 50.0, "y_max": 40.0})]
    assert answers[1]["detections"] == []  # blue scores 0.3, under the threshold
    # The same file through /detect: the same detections.
    _, _, detect = server.request("POST", "/detect?threshold=0.5", files[0], {"Content-Type": "image/png"})
    assert detect["detections"] == answers[0]["detections"]


def test_the_outputs_list_selects_what_comes_back(client):
    result = client.infer("blob", [pixels_input(RED_GREEN[None], True)],
                          outputs=[triton.InferRequestedOutput("detection_scores")])
    names = [o["name"] for o in result.get_response()["outputs"]]
    assert names == ["detection_scores"]


def test_a_version_that_is_not_served_is_404_and_an_unknown_model_names_the_ones_there(client, server):
    with pytest.raises(InferenceServerException) as refused:
        client.infer("blob", [pixels_input(RED_GREEN[None], True)], model_version="1")
    assert str(refused.value.status()) == "404", refused.value
    status, _, body = server.request("POST", "/v2/models/blob/versions/1/infer",
                                     json.dumps({"inputs": []}).encode(), {"Content-Type": "application/json"})
    assert status == 404 and set(body) == {"error"}
    status, _, body = server.request("GET", "/v2/models/nope")
    assert status == 404 and "blob" in body["error"]


@pytest.mark.parametrize("payload, fragment", [
    ({"inputs": [{"name": "input_tensor", "shape": [1, 2, 2, 3], "datatype": "UINT8", "data": [1, 2]}]},
     "shape [1, 2, 2, 3]"),
    ({"inputs": [{"name": "input_tensor", "shape": [1, 2, 2], "datatype": "UINT8", "data": [0] * 4}]}, "input_tensor"),
    ({"inputs": [{"name": "nope", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}, "nope"),
    ({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["bm90IGFuIGltYWdl"]}]}, "image"),
    ({"inputs": "no"}, "inputs"),
])
def test_bad_infer_requests_get_400_in_the_v2_error_shape(server, payload, fragment):
    status, headers, body = server.request("POST", "/v2/models/blob/infer", json.dumps(payload).encode(),
                                           {"Content-Type": "application/json"})
    assert status == 400, body
    assert set(body) == {"error"} and fragment in body["error"]
    assert "Traceback" not in body["error"]


def test_the_model_configuration_is_tritons_json_form_with_the_batching_the_server_applies(client, server):
    config = client.get_model_config("blob")
    assert config["name"] == "blob" and config["platform"] == "tensorflow_savedmodel"
    assert config["max_batch_size"] == 16  # the default max_batch_size: the blob model's batch dimension is free
    assert config["input"] == [{"name": "input_tensor", "data_type": "TYPE_UINT8", "format": "FORMAT_NHWC",
                                "dims": [-1, -1, 3], "is_shape_tensor": False, "allow_ragged_batch": False,
                                "optional": False}]
    outputs = {o["name"]: (o["data_type"], o["dims"]) for o in config["output"]}
    assert outputs["detection_boxes"][0] == "TYPE_FP32" and outputs["detection_boxes"][1][-1] == 4
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 0
    assert config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] > 0
    assert config["instance_group"][0]["count"] == 2  # inference_threads
    assert client.get_model_config("blob", "2") == config
    status, _, body = server.request("GET", "/v2/models/blob/versions/1/config")
    assert status == 404 and "version" in body["error"]


@pytest.mark.parametrize("parameters", [
    {"triton_enable_empty_final_response": True, "triton_anything": "x", "some_backend_option": 3},
    {"threshold": "0.5", "max_detections": "1", "timeout": "30000000", "priority": "0"},
])
def test_parameters_the_server_does_not_use_are_ignored_and_numbers_may_come_as_strings(server, parameters):
    """Triton's C++ clients add triton_-prefixed parameters (tritonclient.http refuses to send them itself)."""
    payload = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                           "data": [base64.b64encode(encode(RED_GREEN)).decode()]}],
               "outputs": [{"name": "detections"}], "parameters": parameters}
    status, _, body = server.request("POST", "/v2/models/blob/infer", json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})
    assert status == 200, body
    answer = json.loads(body["outputs"][0]["data"][0])
    assert len(answer["detections"]) == (1 if "max_detections" in parameters else 2)


@pytest.mark.parametrize("parameters, fragment", [
    ({"threshold": "half"}, "threshold"), ({"threshold": 2}, "threshold"), ({"threshold": "nan"}, "threshold"),
    ({"max_detections": "1.5"}, "max_detections"), ({"max_detections": 0}, "max_detections"),
    ({"timeout": -1}, "timeout"), ({"priority": "high"}, "priority"), ({"sequence_id": 7}, "sequence"),
])
def test_parameters_the_server_uses_are_still_checked_naming_them(server, parameters, fragment):
    payload = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                           "data": [base64.b64encode(encode(BLUE)).decode()]}], "parameters": parameters}
    status, _, body = server.request("POST", "/v2/models/blob/infer", json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})
    assert status == 400 and fragment in body["error"], body


def test_the_body_may_name_the_model_as_kserves_sdk_does_and_must_agree_with_the_path(server):
    def infer(**names):
        payload = {**names, "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                        "data": [base64.b64encode(encode(BLUE)).decode()]}]}
        return server.request("POST", "/v2/models/blob/infer", json.dumps(payload).encode(),
                              {"Content-Type": "application/json"})

    status, _, body = infer(model_name="blob", model_version="2")
    assert status == 200 and body["model_name"] == "blob" and body["model_version"] == "2"
    status, _, body = infer(model_name="other")
    assert status == 400 and "'other'" in body["error"] and "'blob'" in body["error"]
    status, _, body = infer(model_name="blob", model_version="1")
    assert status == 404 and "version" in body["error"]


def test_health_answers_carry_kserves_bodies_and_keep_tritons_statuses(server):
    assert server.request("GET", "/v2/health/live")[::2] == (200, {"live": True})
    assert server.request("GET", "/v2/health/ready")[::2] == (200, {"ready": True})
    assert server.request("GET", "/v2/models/blob/ready")[::2] == (200, {"name": "blob", "ready": True})
    assert server.request("GET", "/v2/models/blob/versions/1/ready")[0] == 404


@pytest.mark.parametrize("method, path, extension", [
    ("GET", "/v2/cudasharedmemory/status", "CUDA shared memory"), ("POST", "/v2/trace/setting", "trace"),
    ("GET", "/v2/logging", "logging"),
])
def test_an_extension_the_server_lacks_answers_400_naming_it_not_404(server, method, path, extension):
    status, _, body = server.request(method, path, b"{}" if method == "POST" else None)
    assert status == 400 and body == {"error": f"the {extension} extension is not implemented by this server"}


def test_statistics_count_each_image_and_each_model_call_and_split_the_time(client, server):
    """After N inferences of 2 images each, inference_count grew by 2N and execution_count by at most N; the stages
    add up to the success time, which no more than the clients' own latency."""
    def stats():
        answer = client.get_inference_statistics("blob")
        (entry,) = answer["model_stats"]
        return entry

    before = stats()
    assert before["name"] == "blob" and before["version"] == "2"
    batch = np.stack([RED_GREEN, RED_GREEN])
    started = time.perf_counter()
    with triton.InferenceServerClient(f"127.0.0.1:{server.port}", concurrency=8) as concurrent:
        pending = [concurrent.async_infer("blob", [pixels_input(batch, True)]) for _ in range(16)]
        for call in pending:
            call.get_result()
    elapsed_ns = (time.perf_counter() - started) * 1e9 * 8  # at most 8 requests in flight at once
    after = stats()
    assert after["inference_count"] - before["inference_count"] == 32
    calls = after["execution_count"] - before["execution_count"]
    assert 1 <= calls <= 16
    done = {key: {k: after["inference_stats"][key][k] - before["inference_stats"][key][k] for k in ("count", "ns")}
            for key in after["inference_stats"]}
    assert done["success"]["count"] == 16 and done["fail"]["count"] == 0
    parts = sum(done[key]["ns"] for key in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert abs(parts - done["success"]["ns"]) <= 16 * 1000  # rounding to whole ns, per stage and request
    assert 0 < done["compute_infer"]["ns"] and done["success"]["ns"] <= elapsed_ns
    assert after["last_inference"] >= before["last_inference"] and after["last_inference"] > 0
    sizes = {entry["batch_size"]: entry["compute_infer"]["count"] for entry in after["batch_stats"]}
    assert sum(size * count for size, count in sizes.items()) >= 32
    everyone = client.get_inference_statistics()
    assert [m["name"] for m in everyone["model_stats"]] == ["blob"]
    status, _, body = server.request("GET", "/v2/models/blob/versions/1/stats")
    assert status == 404 and "version" in body["error"]


def test_tritonclient_reports_a_refusal_with_the_servers_message(client):
    bad = triton.InferInput("input_tensor", [1, 4, 4], "UINT8")
    bad.set_data_from_numpy(np.zeros((1, 4, 4), np.uint8))
    with pytest.raises(InferenceServerException) as refused:
        client.infer("blob", [bad])
    assert "input_tensor" in refused.value.message()


def test_a_gzip_body_is_inflated(server):
    payload = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                           "data": [base64.b64encode(encode(RED_GREEN)).decode()]}],
               "outputs": [{"name": "num_detections"}]}
    status, _, body = server.request("POST", "/v2/models/blob/infer", gzip.compress(json.dumps(payload).encode()),
                                     {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 200, body
    assert body["outputs"][0]["data"] == [2.0]
    status, _, body = server.request("POST", "/v2/models/blob/infer", b"not gzip",
                                     {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 400 and "error" in body


# TF Serving REST ---------------------------------------------------------------------------------------------

def test_tf_serving_model_status_and_metadata(server):
    status, _, body = server.request("GET", "/v1/models/blob")
    assert status == 200
    assert body["model_version_status"][0]["version"] == "2"
    assert body["model_version_status"][0]["state"] == "AVAILABLE"
    status, _, body = server.request("GET", "/v1/models/blob/metadata")
    assert status == 200 and body["model_spec"]["name"] == "blob"
    signature = body["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert "input_tensor" in signature["inputs"] and "detection_boxes" in signature["outputs"]
    status, _, body = server.request("GET", "/v1/models/nope")
    assert status == 404 and set(body) == {"error"}


def test_tf_serving_predict_row_form_with_pixels_and_b64(server):
    request = {"instances": [RED_GREEN.tolist(), {"b64": base64.b64encode(encode(BLUE)).decode()}]}
    status, _, body = server.request("POST", "/v1/models/blob:predict", json.dumps(request).encode(),
                                     {"Content-Type": "application/json"})
    assert status == 200, body
    first, second = body["predictions"]
    assert first["num_detections"] == 2.0 and first["detection_classes"][:2] == [1.0, 2.0]
    np.testing.assert_allclose(first["detection_boxes"][:2], [RED_BOX, GREEN_BOX], atol=1e-6)
    assert second["num_detections"] == 1.0 and second["detection_classes"][0] == 3.0


def test_tf_serving_predict_columnar_form(server):
    request = {"inputs": [RED_GREEN.tolist()]}
    status, _, body = server.request("POST", "/v1/models/blob/versions/2:predict", json.dumps(request).encode(),
                                     {"Content-Type": "application/json"})
    assert status == 200, body
    assert body["outputs"]["num_detections"] == [2.0]


@pytest.mark.parametrize("path, payload, status", [
    ("/v1/models/blob:predict", {"instances": []}, 400),
    ("/v1/models/blob:predict", {"nothing": 1}, 400),
    ("/v1/models/blob:predict", {"instances": [{"b64": "!!!"}]}, 400),
    ("/v1/models/blob/versions/1:predict", {"instances": [[[[0, 0, 0]]]]}, 404),
])
def test_tf_serving_refusals_in_its_error_shape(server, path, payload, status):
    got, _, body = server.request("POST", path, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    assert got == status, body
    assert set(body) == {"error"} and body["error"]


# OpenAPI -----------------------------------------------------------------------------------------------------

def test_the_openapi_document_is_valid_and_names_every_protocol(server):
    from openapi_spec_validator import validate

    status, headers, document = server.request("GET", "/openapi.json")
    assert status == 200
    validate(document)
    paths = set(document["paths"])
    assert {"/detect", "/v2/models/{name}/infer", "/v1/models/{name}:predict", "/models"} <= paths


def test_every_parameter_of_every_operation_in_the_openapi_document_has_a_description(server):
    """A reader of the routes reference (or a generated client) learns what each parameter does, max_detections too."""
    status, _, document = server.request("GET", "/openapi.json")
    assert status == 200
    shared = document.get("components", {}).get("parameters", {})
    seen, lacking = 0, []
    for path, item in document["paths"].items():
        operations = [(method, op) for method, op in item.items() if method in ("get", "put", "post", "delete", "patch")]
        for method, operation in [("(path)", item), *operations]:
            for parameter in operation.get("parameters", []):
                if "$ref" in parameter:
                    parameter = shared[parameter["$ref"].rsplit("/", 1)[-1]]
                seen += 1
                if not str(parameter.get("description", "")).strip():
                    lacking.append(f"{method.upper()} {path} {parameter['in']} {parameter['name']}")
    assert seen > 20 and lacking == [], lacking


def test_fuzzing_the_openapi_description_finds_no_server_error_and_no_answer_outside_it(blob_model_dir, tmp_path):
    """A bounded, deterministic schemathesis run over every documented operation but the repository's, which
    unload the model on purpose (tests/test_models.py drives those); any 5xx or undocumented answer fails."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from conftest import start_server

    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st, "schemathesis is in the test extra"
    fuzzed = start_server({"DETECT_MODEL": str(blob_model_dir), "DETECT_MAX_BODY_BYTES": "2MiB"},
                          tmp_path / "server.log")
    try:
        run = subprocess.run(
            [st, "run", f"http://127.0.0.1:{fuzzed.port}/openapi.json", "--max-examples", "20",
             "--generation-deterministic", "--phases", "examples,coverage,fuzzing",
             "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                         "response_schema_conformance",
             "--exclude-path-regex", "^/v2/repository", "--request-timeout", "60",
             "--suppress-health-check", "all", "--no-color"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its cache stays out of the checkout
        status, _, answer = fuzzed.request("POST", "/detect", encode(RED_GREEN), {"Content-Type": "image/png"})
        assert status == 200 and len(answer["detections"]) == 2  # still serving afterwards
    finally:
        fuzzed.stop()
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "Traceback" not in fuzzed.log()


@pytest.mark.parametrize("input_type", ["float_image_tensor", "encoded_image_string_tensor"])
def test_the_other_export_types_serve_every_route_with_boxes_as_the_user_sees_the_image(tmp_path, input_type):
    """A model exported with each of the Object Detection API's other input types, behind a real server:
    /detect, KServe v2 (encoded files) and TF Serving (b64) agree, EXIF orientation applied."""
    from blob_model import build_blob_model
    from conftest import start_server
    from images_for_tests import ORIENT

    base = tmp_path / "other"
    build_blob_model(base / "1", input_type=input_type)
    stored = blob_image(60, 40, {1: (5, 10, 15, 20)})
    data = encode(stored, "JPEG", orientation=6, quality=100, subsampling=0)
    seen = ORIENT[6](stored)
    ys, xs = np.nonzero(seen[..., 0] > 200)
    expected = (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))
    served = start_server({"DETECT_MODEL": str(base)}, tmp_path / "server.log")
    try:
        status, _, answer = served.request("POST", "/detect", data, {"Content-Type": "image/jpeg"})
        assert status == 200, answer
        (found,) = answer["detections"]
        assert tuple(found["box"][k] for k in ("x_min", "y_min", "x_max", "y_max")) == pytest.approx(expected, abs=1.0)
        with triton.InferenceServerClient(f"127.0.0.1:{served.port}") as v2:
            result = v2.infer("other", [files_input([data])], outputs=[triton.InferRequestedOutput("detections")])
        assert json.loads(result.as_numpy("detections")[0])["detections"] == answer["detections"]
        status, _, predicted = served.request(
            "POST", "/v1/models/other:predict",
            json.dumps({"instances": [{"b64": base64.b64encode(data).decode()}]}).encode(),
            {"Content-Type": "application/json"})
        assert status == 200, predicted
        height, width = seen.shape[:2]
        box = np.array(predicted["predictions"][0]["detection_boxes"][0]) * [height, width, height, width]
        assert (box[1], box[0], box[3], box[2]) == pytest.approx(expected, abs=1.0)
    finally:
        served.stop()
