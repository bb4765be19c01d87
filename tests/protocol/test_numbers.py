"""Every number a client sends is checked for its range, as a number and as a string holding one: a bad one is a
400 or INVALID_ARGUMENT naming it, never a 500, an INTERNAL, or a traceback in the log. Before, a `timeout` of
10**310 raised OverflowError on every such request (HTTP 500, gRPC INTERNAL, a traceback at ERROR)."""

from __future__ import annotations

import json
import math

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from blob_model import blob_image

IMAGE = blob_image(16, 12, {1: (2, 2, 6, 6)})
PIXELS = {"name": "input_tensor", "datatype": "UINT8", "shape": [1, *IMAGE.shape], "data": IMAGE.ravel().tolist()}
HUGE = 10**310  # past any float: float(HUGE) overflows

# (parameter, value) pairs every door must refuse naming the parameter.
BAD = [
    ("timeout", HUGE), ("timeout", -1), ("timeout", 2**64), ("timeout", 1.5), ("timeout", "1e400"),
    ("timeout", str(HUGE)), ("timeout", "-5"), ("timeout", "ten"), ("timeout", True),
    ("priority", HUGE), ("priority", -1), ("priority", 2**64), ("priority", "x"),
    ("max_detections", 0), ("max_detections", HUGE), ("max_detections", "1e3"), ("max_detections", 1001),
    ("threshold", math.inf), ("threshold", math.nan), ("threshold", -0.5), ("threshold", HUGE),
    ("threshold", "1e400"), ("threshold", "nan"), ("threshold", "0.5" + "0" * 100),
]
GOOD = [("timeout", 2**64 - 1), ("timeout", "30000000"), ("priority", 2**64 - 1), ("priority", "0"),
        ("max_detections", "7"), ("threshold", "0.25"), ("threshold", 1)]


def v2_body(parameters: dict) -> bytes:
    # Python's json writes inf and nan as Infinity and NaN, which the server's parser reads (as Python's does).
    return json.dumps({"inputs": [PIXELS], "parameters": parameters}).encode()


@pytest.mark.parametrize("key, value", BAD, ids=[f"{k}={str(v)[:12]}" for k, v in BAD])
def test_a_number_out_of_range_is_a_400_naming_it_over_http(server, key, value):
    status, _, body = server.request("POST", "/v2/models/blob/infer", v2_body({key: value}))
    assert status == 400 and f"the parameter {key} must be" in body["error"], body


@pytest.mark.parametrize("key, value", GOOD, ids=[f"{k}={str(v)[:12]}" for k, v in GOOD])
def test_a_number_in_range_is_taken_as_a_number_or_a_string(server, key, value):
    status, _, body = server.request("POST", "/v2/models/blob/infer", v2_body({key: value}))
    assert status == 200, body


def grpc_parameter(request, key: str, value) -> bool:
    """Set `value` in the field an InferParameter has for it; False where the wire has no such number."""
    parameter = request.parameters[key]
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int) and -2**63 <= value < 2**63:
        parameter.int64_param = value
    elif isinstance(value, int) and 0 <= value < 2**64:
        parameter.uint64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    elif isinstance(value, str):
        parameter.string_param = value
    else:
        return False
    return True


GRPC_BAD = [(k, v) for k, v in BAD if not (isinstance(v, int) and not isinstance(v, bool) and v >= 2**64)]


@pytest.mark.parametrize("key, value", GRPC_BAD, ids=[f"{k}={str(v)[:12]}" for k, v in GRPC_BAD])
def test_a_number_out_of_range_is_invalid_argument_naming_it_over_grpc(server, key, value):
    request = service_pb2.ModelInferRequest(model_name="blob")
    request.inputs.add(name="input_tensor", datatype="UINT8", shape=[1, *IMAGE.shape])
    request.raw_input_contents.append(IMAGE.tobytes())
    assert grpc_parameter(request, key, value)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the parameter {key} must be" in refused.value.details()


@pytest.mark.parametrize("field, value", [("shared_memory_offset", HUGE), ("shared_memory_offset", -1),
                                          ("shared_memory_offset", "12"), ("shared_memory_byte_size", 2**70),
                                          ("shared_memory_byte_size", 1.0), ("shared_memory_byte_size", "4")])
def test_a_shared_memory_offset_or_size_out_of_range_is_a_400(server, field, value):
    parameters = {"shared_memory_region": "nowhere", "shared_memory_byte_size": 4, field: value}
    tensor = {"name": "image", "datatype": "BYTES", "shape": [1], "parameters": parameters}
    status, _, body = server.request("POST", "/v2/models/blob/infer", json.dumps({"inputs": [tensor]}).encode())
    assert status == 400, body
    assert field in body["error"] or "not registered" in body["error"]


@pytest.mark.parametrize("offset, size", [(HUGE, 4), (2**63, 4), (0, HUGE), (-1, 4), (0, "4")])
def test_a_registration_out_of_range_is_a_400(server, offset, size):
    body = json.dumps({"key": "/detect-test-absent", "offset": offset, "byte_size": size}).encode()
    status, _, answer = server.request("POST", "/v2/systemsharedmemory/region/r/register", body)
    assert status == 400, answer


@pytest.mark.parametrize("query", ["threshold=1e400", "threshold=nan", "threshold=" + "9" * 5000,
                                   "max_detections=" + "9" * 5000, "max_detections=-1", "max_detections=1e3"])
def test_a_detect_query_number_out_of_range_is_a_400(server, query):
    from images_for_tests import encode

    status, _, body = server.request("POST", f"/detect?{query}", encode(IMAGE, "PNG"), {"Content-Type": "image/png"})
    assert status == 400 and body["error"]["code"] == "invalid_parameter", body


def test_no_number_left_a_traceback_in_the_log(server):
    """Run last in this file: every refusal above was a refusal, not an exception the server logged."""
    assert "Traceback" not in server.log() and "OverflowError" not in server.log()
