"""The KServe v2 codec and the body inflater, as pure functions: against tritonclient's own encoder and decoder,
on every refusal Triton's HTTP tests (qa/L0_http) make, and fuzzed with hypothesis."""

from __future__ import annotations

import gzip
import json
import zlib

import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.errors import BadRequest, BodyTooLarge, DetectError, InvalidBody, UnsupportedContentEncoding
from app.protocol.bodies import inflate
from app.protocol.v2_codec import (
    NUMPY_TYPES, Tensor, parse_infer_request, serialize_bytes, write_infer_response,
)


def request_body(inputs: list, outputs=None, parameters=None) -> tuple[bytes, str | None]:
    """Encode a request with tritonclient's own encoder; return the body and the header-length header."""
    body, json_size = triton.InferenceServerClient.generate_request_body(inputs, outputs=outputs,
                                                                         parameters=parameters)
    return body, None if json_size is None else str(json_size)


def infer_input(name: str, array: np.ndarray, datatype: str, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_requests_parse_to_the_tensors_it_sent(binary):
    pixels = np.arange(2 * 3 * 4 * 3, dtype=np.uint8).reshape(2, 3, 4, 3)
    files = np.array([b"\x89PNG first", b"second\x00file"], dtype=object)
    inputs = [infer_input("input_tensor", pixels, "UINT8", binary)]
    if binary:  # BYTES in JSON must be UTF-8 text: files go as binary only
        inputs.append(infer_input("image", files, "BYTES", True))
    outputs = [triton.InferRequestedOutput("detection_boxes", binary_data=False),
               triton.InferRequestedOutput("detections", binary_data=True)]
    body, length = request_body(inputs, outputs, parameters={"threshold": 0.25})
    parsed = parse_infer_request(body, length)
    assert parsed.inputs[0].name == "input_tensor" and parsed.inputs[0].binary is binary
    np.testing.assert_array_equal(parsed.inputs[0].data, pixels)
    assert parsed.inputs[0].data.dtype == np.uint8 and parsed.inputs[0].shape == (2, 3, 4, 3)
    if binary:
        assert parsed.inputs[1].data == [b"\x89PNG first", b"second\x00file"]
    assert [(o.name, o.binary) for o in parsed.outputs] == [("detection_boxes", False), ("detections", True)]
    assert parsed.parameters == {"threshold": 0.25} and parsed.binary_output is False


def test_a_request_without_outputs_asks_for_every_output_as_binary():
    """tritonclient sets binary_data_output when no output is named, so that all come back as binary data."""
    body, length = request_body([infer_input("image", np.array([b"x"], dtype=object), "BYTES", True)])
    parsed = parse_infer_request(body, length)
    assert parsed.outputs is None and parsed.binary_output is True and "binary_data_output" not in parsed.parameters


def test_json_data_may_be_flat_or_nested_as_the_shape():
    for data in ([1, 2, 3, 4, 5, 6], [[1, 2, 3], [4, 5, 6]]):
        body = json.dumps({"inputs": [{"name": "x", "datatype": "INT16", "shape": [2, 3], "data": data}]}).encode()
        tensor = parse_infer_request(body, None).inputs[0]
        np.testing.assert_array_equal(tensor.data, np.array([[1, 2, 3], [4, 5, 6]], np.int16))


def test_a_raw_request_is_its_whole_body():
    """Inference-Header-Content-Length: 0 (Triton's raw binary request): the body is the one input's data."""
    parsed = parse_infer_request(b"\xff\xd8 a jpeg", "0")
    assert parsed.raw == b"\xff\xd8 a jpeg" and parsed.binary_output is True and parsed.inputs == ()


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_reads_the_responses_written(binary):
    boxes = np.linspace(0, 1, 2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    answers = [b'{"detections": []}', b'{"width": 3}']
    outputs = [(Tensor("detection_boxes", "FP32", boxes.shape, boxes), binary),
               (Tensor("detections", "BYTES", (2,), answers), not binary)]
    body, header_length = write_infer_response("blob", "2", "req-7", outputs)
    result = triton.InferResult.from_response_body(body, header_length=header_length)
    np.testing.assert_array_equal(result.as_numpy("detection_boxes"), boxes)
    got = result.as_numpy("detections")
    assert [g if isinstance(g, bytes) else g.encode() for g in got] == answers
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == ("blob", "2", "req-7")


def test_bytes_elements_are_length_prefixed_little_endian():
    assert serialize_bytes([b"ab", b""]) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"


def _header(inputs: list, outputs=None, **extra) -> bytes:
    document = {"inputs": inputs, **extra}
    if outputs is not None:
        document["outputs"] = outputs
    return json.dumps(document).encode()


def _binary(header: bytes, data: bytes) -> tuple[bytes, str]:
    return header + data, str(len(header))


PIXELS = {"name": "input_tensor", "datatype": "UINT8", "shape": [1, 1, 2, 3], "data": [1, 2, 3, 4, 5, 6]}

# Each case: (body, Inference-Header-Content-Length, a fragment of the error). Triton's qa/L0_http refusals.
REFUSALS = {
    "header length beyond the body": (b'{"inputs": []}', "1000", "beyond the body"),
    "header length not a number": (b'{"inputs": []}', "-5", "non-negative integer"),
    "negative dimension": (_header([{**PIXELS, "shape": [1, -1, 2, 3]}]), None, "at least 1"),
    "zero dimension": (_header([{**PIXELS, "shape": [1, 0, 2, 3]}]), None, "at least 1"),
    "enormous dimensions": (_header([{**PIXELS, "shape": [2**4, 2**60 + 2, 2**60, 3]}]), None,
                            "elements) but 'data' holds 6"),
    "a dimension that is not an integer": (_header([{**PIXELS, "shape": [1, 1.5, 2, 3]}]), None, "at least 1"),
    "too many dimensions": (_header([{**PIXELS, "shape": [1] * 9}]), None, "1 to 8 dimensions"),
    "JSON data of the wrong size": (_header([{**PIXELS, "data": [1, 2, 3]}]), None, "holds 3"),
    "JSON data out of the datatype's range": (_header([{**PIXELS, "data": [1, 2, 3, 4, 5, 256]}]), None,
                                              "from 0 to 255"),
    "JSON floats for an integer datatype": (_header([{**PIXELS, "data": [1, 2, 3, 4, 5, 6.5]}]), None,
                                            "must hold integers"),
    "JSON data nested deeper than the shape": (_header([{**PIXELS, "shape": [6], "data": [[1, 2, 3, 4, 5, 6]]}]),
                                               None, "holds 6 in shape [1, 6]"),
    "ragged JSON data": (_header([{**PIXELS, "shape": [2, 3], "data": [[1, 2, 3], [4, 5]]}]), None,
                         "not a list of numbers"),
    "binary data of the wrong size": _binary(_header([{
        "name": "input_tensor", "datatype": "UINT8", "shape": [1, 2, 2, 3],
        "parameters": {"binary_data_size": 11}}]), b"x" * 11) + ("binary_data_size is 11",),
    "binary_data_size beyond the body": _binary(_header([{
        "name": "image", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 100}}]),
        b"x" * 10) + ("beyond the 10 bytes left",),
    "a BYTES length prefix running past the end": _binary(_header([{
        "name": "image", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 8}}]),
        b"\xff\xff\x00\x00abcd") + ("past the end of the data",),
    "a BYTES element without its length prefix": _binary(_header([{
        "name": "image", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 8}}]),
        b"\x01\x00\x00\x00a\x01\x00\x00") + ("no length prefix",),
    "more BYTES elements than the bytes can hold": _binary(_header([{
        "name": "image", "datatype": "BYTES", "shape": [1000], "parameters": {"binary_data_size": 8}}]),
        b"\x00" * 8) + ("more than 8 bytes can hold",),
    "binary data that no input claims": _binary(_header([{
        "name": "image", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 5}}]),
        b"\x01\x00\x00\x00a" + b"extra") + ("no input claims",),
    "binary_data_size without the header": (_header([{
        "name": "image", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 5}}]), None,
        "has no Inference-Header-Content-Length"),
    "duplicate output names": (_header([PIXELS], [{"name": "detection_boxes"}, {"name": "detection_boxes"}]), None,
                               "duplicate output name 'detection_boxes'"),
    "duplicate input names": (_header([PIXELS, PIXELS]), None, "duplicate input name"),
    "an unknown datatype": (_header([{**PIXELS, "datatype": "FP8"}]), None, "the datatypes are"),
    "no inputs": (_header([]), None, "non-empty list"),
    "an input without a name": (_header([{**PIXELS, "name": ""}]), None, "needs a 'name'"),
    "an unknown field": (_header([PIXELS], extra_field=1), None, "unknown field 'extra_field'"),
    "a JSON header nested 100,000 deep": (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None,
                                          "nested too deeply"),
    "JSON data nested 100,000 deep": (b'{"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": '
                                      + b"[" * 100_000 + b"1" + b"]" * 100_000 + b"}]}", None, "nested too deeply"),
    "a header that is not JSON": (b"\x00\xff not json", None, "not valid JSON"),
    "a header that is a list": (b"[]", None, "must be a JSON object"),
    "a parameter that is an object": (_header([PIXELS], parameters={"threshold": {"a": 1}}), None,
                                      "boolean, number or string"),
    "binary_data_output not a boolean": (_header([PIXELS], parameters={"binary_data_output": "yes"}), None,
                                         "true or false"),
    "a shared-memory input without its byte size": (_header([{"name": "x", "datatype": "UINT8", "shape": [1],
                                                               "parameters": {"shared_memory_region": "r"}}]), None,
                                                     "shared_memory_byte_size must be a whole number"),
    "a shared-memory input that also carries data": (_header([{
        "name": "x", "datatype": "UINT8", "shape": [1], "data": [1],
        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 1}}]), None, "also carries data"),
    "a shared-memory parameter Triton does not define": (_header([{
        "name": "x", "datatype": "UINT8", "shape": [1],
        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 1, "shared_memory_handle": 3}}]),
        None, "unknown parameter 'shared_memory_handle'"),
    "a classification output": (_header([PIXELS], [{"name": "detection_scores",
                                                    "parameters": {"classification": 3}}]), None,
                                "classification extension is not implemented"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_malformed_requests_are_refused_naming_the_problem_at_once(case):
    body, length, fragment = REFUSALS[case]
    with pytest.raises(BadRequest) as refused:
        parse_infer_request(body, length)
    assert fragment in refused.value.message


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(datatype=st.sampled_from(sorted(NUMPY_TYPES)), shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       binary=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_every_numeric_datatype_round_trips_through_tritonclient(datatype, shape, binary, seed):
    """What tritonclient encodes parses to the same array, and what is written it decodes to the same array."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(NUMPY_TYPES[datatype])
    if dtype.kind == "b":
        array = rng.integers(0, 2, shape).astype(bool)
    elif dtype.kind == "f":
        array = rng.uniform(-1000, 1000, shape).astype(dtype)
    else:
        info = np.iinfo(dtype)
        array = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    body, length = request_body([infer_input("x", array, datatype, binary)])
    tensor = parse_infer_request(body, length).inputs[0]
    np.testing.assert_array_equal(tensor.data, array)
    assert tensor.data.dtype == dtype
    answer, header_length = write_infer_response("m", None, None, [(Tensor("y", datatype, array.shape, array), binary)])
    np.testing.assert_array_equal(triton.InferResult.from_response_body(answer, header_length=header_length)
                                  .as_numpy("y"), array)


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=300), length=st.one_of(st.none(), st.integers(0, 400).map(str), st.text(max_size=5)))
def test_arbitrary_bytes_get_a_request_or_a_clear_refusal(body, length):
    try:
        parse_infer_request(body, length)
    except DetectError as exc:
        assert isinstance(exc, BadRequest) and exc.message


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(inputs=st.lists(st.fixed_dictionaries({
    "name": st.sampled_from(["input_tensor", "image", ""]), "datatype": st.sampled_from(["UINT8", "BYTES", "FP32"]),
    "shape": st.lists(st.integers(-2, 3), max_size=5)}, optional={"data": JSON_VALUES, "parameters": JSON_VALUES}),
    max_size=3), outputs=st.one_of(st.none(), JSON_VALUES), parameters=st.one_of(st.none(), JSON_VALUES))
def test_arbitrary_headers_get_a_request_or_a_clear_refusal(inputs, outputs, parameters):
    document = {"inputs": inputs, "outputs": outputs, "parameters": parameters}
    try:
        parsed = parse_infer_request(json.dumps({k: v for k, v in document.items() if v is not None}).encode(), None)
    except DetectError as exc:
        assert isinstance(exc, BadRequest) and exc.message
        return
    for tensor in parsed.inputs:
        assert all(dim >= 1 for dim in tensor.shape)


# Inflating bodies ------------------------------------------------------------------------------------------

PAYLOAD = b'{"inputs": []}' * 100


@pytest.mark.parametrize("encoding, packed", [
    ("gzip", gzip.compress(PAYLOAD)), ("x-gzip", gzip.compress(PAYLOAD)), ("deflate", zlib.compress(PAYLOAD)),
    ("deflate", zlib.compress(PAYLOAD)[2:-4]),  # raw deflate, as some clients send it
    ("GZIP ", gzip.compress(PAYLOAD[:700]) + gzip.compress(PAYLOAD[700:])),  # two members
    ("identity", PAYLOAD), (None, PAYLOAD)])
def test_gzip_and_deflate_bodies_inflate(encoding, packed):
    assert inflate(packed, encoding, limit=len(PAYLOAD)) == PAYLOAD


def test_a_small_body_that_inflates_past_the_limit_is_refused_without_being_held():
    bomb = gzip.compress(b"\x00" * (64 * 2**20))  # 64 MiB in about 64 KB
    with pytest.raises(BodyTooLarge, match="inflates to more than the limit of 1048576 bytes"):
        inflate(bomb, "gzip", limit=2**20)


@pytest.mark.parametrize("encoding, packed, error, fragment", [
    ("gzip", gzip.compress(PAYLOAD)[:-10], InvalidBody, "truncated"),
    ("gzip", b"not gzip at all", InvalidBody, "corrupt"),
    ("deflate", zlib.compress(PAYLOAD) + b"junk", InvalidBody, "after its end"),
    ("br", PAYLOAD, UnsupportedContentEncoding, "'br' is not accepted"),
    ("gzip, deflate", PAYLOAD, UnsupportedContentEncoding, "is not accepted"),
])
def test_bad_compressed_bodies_are_refused(encoding, packed, error, fragment):
    with pytest.raises(error, match=fragment):
        inflate(packed, encoding, limit=10 * len(PAYLOAD))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), encoding=st.sampled_from(["gzip", "deflate"]))
def test_arbitrary_compressed_bytes_inflate_or_are_refused(data, encoding):
    try:
        assert len(inflate(data, encoding, limit=1000)) <= 1000
    except DetectError as exc:
        assert isinstance(exc, (InvalidBody, BodyTooLarge))
