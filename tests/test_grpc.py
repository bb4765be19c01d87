"""The gRPC services driven by the real, unmodified clients: tritonclient.grpc (KServe v2), TF Serving's
PredictionServiceStub (tensorflow-serving-api), grpcio's health and reflection clients, against real servers
on the blob model, whose answers are known exactly; the bad-input battery and the status-code table."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from blob_model import blob_image
from images_for_tests import encode

RED_GREEN = blob_image(64, 48, {1: (10, 5, 20, 15), 2: (30, 20, 50, 40)})
BLUE = blob_image(32, 32, {3: (4, 4, 12, 12)})
RED_BOX = [5 / 48, 10 / 64, 15 / 48, 20 / 64]
GREEN_BOX = [20 / 48, 30 / 64, 40 / 48, 50 / 64]
OUTPUTS = ("detection_boxes", "detection_classes", "detection_scores", "num_detections")


@pytest.fixture(scope="module")
def client(server):
    with triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as with_client:
        yield with_client


@pytest.fixture(scope="module")
def stub(server):
    """Triton's generated stub, for requests tritonclient would never send (the bad-input battery)."""
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def pixels_input(array: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("input_tensor", list(array.shape), "UINT8")
    tensor.set_data_from_numpy(array)
    return tensor


def files_input(files: list[bytes]) -> triton.InferInput:
    tensor = triton.InferInput("image", [len(files)], "BYTES")
    tensor.set_data_from_numpy(np.array(files, dtype=object))
    return tensor


def code_of(refused: pytest.ExceptionInfo) -> str:
    """The gRPC status code name of a tritonclient refusal (StatusCode.NOT_FOUND -> NOT_FOUND)."""
    return str(refused.value.status()).rsplit(".", 1)[-1]


# KServe v2 with tritonclient.grpc ---------------------------------------------------------------------------

def test_server_metadata_liveness_and_readiness(client):
    metadata = client.get_server_metadata(as_json=True)
    assert metadata["name"] == "gpu-share-detect" and metadata["version"]
    assert "model_repository" in metadata["extensions"]
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("blob") and client.is_model_ready("blob", "2")
    assert not client.is_model_ready("blob", "1")  # on disk, not the version served


def test_model_metadata_and_config_are_the_signature(client):
    metadata = client.get_model_metadata("blob", as_json=True)
    assert metadata["name"] == "blob" and metadata["platform"] == "tensorflow_savedmodel"
    assert metadata["versions"] == ["2"]
    assert metadata["inputs"] == [{"name": "input_tensor", "datatype": "UINT8", "shape": ["-1", "-1", "-1", "3"]}]
    assert {o["name"] for o in metadata["outputs"]} == set(OUTPUTS)
    config = client.get_model_config("blob", as_json=True)["config"]
    assert config["name"] == "blob" and config["input"][0]["data_type"] == "TYPE_UINT8"


def test_the_model_config_is_the_one_the_http_route_gives(client, server):
    """One configuration, two encodings: the gRPC ModelConfig message, read back as JSON, is the HTTP config route's
    document (protobuf's JSON writes int64 as strings, and leaves out fields at their zero value)."""
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    over_grpc = client.get_model_config("blob").config
    status, _, over_http = server.request("GET", "/v2/models/blob/config")
    assert status == 200
    assert over_grpc == json_format.ParseDict(over_http, model_config_pb2.ModelConfig())
    assert over_grpc.dynamic_batching.default_queue_policy.max_queue_size > 0 and over_grpc.max_batch_size == 16


@pytest.mark.parametrize("method", ["CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
                                    "TraceSetting", "LogSettings"])
def test_a_method_the_server_lacks_answers_unimplemented_naming_it(stub, server, method):
    from tritonclient.grpc import service_pb2

    request = getattr(service_pb2, f"{method}Request")()
    with pytest.raises(grpc.RpcError) as refused:
        getattr(stub, method)(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert refused.value.details() == f"inference.GRPCInferenceService/{method} is not implemented by this server"
    assert "Traceback" not in server.log()


def test_statistics_over_grpc_are_the_http_routes(client, server):
    """ModelStatistics answers what GET /v2/models/blob/stats does, read at the same moment (nothing runs between)."""
    from google.protobuf import json_format

    client.infer("blob", [files_input([encode(BLUE)])])
    status, _, over_http = server.request("GET", "/v2/models/blob/stats")
    over_grpc = json_format.MessageToDict(client.get_inference_statistics("blob"), preserving_proto_field_name=True)
    assert status == 200 and over_http["model_stats"][0]["inference_count"] >= 1
    assert json_format.ParseDict(over_http, service_pb2.ModelStatisticsResponse()) == \
        json_format.ParseDict(over_grpc, service_pb2.ModelStatisticsResponse())


def test_tf_serving_classify_answers_unimplemented(tf_channel):
    from tensorflow_serving.apis import classification_pb2, prediction_service_pb2_grpc

    with pytest.raises(grpc.RpcError) as refused:
        prediction_service_pb2_grpc.PredictionServiceStub(tf_channel).Classify(
            classification_pb2.ClassificationRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Classify" in refused.value.details()


def test_a_stream_answers_each_request_with_its_id_and_an_error_without_ending(server):
    """tritonclient.grpc's stream: 12 requests in flight at once, one bad; every id is answered on the stream,
    the bad one with its error_message, the good ones with the unary call's detections."""
    import queue

    answers: queue.SimpleQueue = queue.SimpleQueue()
    with triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as streaming:
        streaming.start_stream(callback=lambda result, error: answers.put((result, error)))
        for i in range(12):
            image = encode(RED_GREEN) if i != 5 else b"not an image"
            streaming.async_stream_infer("blob", [files_input([image])], request_id=f"r{i}",
                                         outputs=[triton.InferRequestedOutput("detections")],
                                         parameters={"max_detections": 1})
        received = [answers.get(timeout=60) for _ in range(12)]
        streaming.stop_stream()
    errors = [error for _, error in received if error is not None]
    assert len(errors) == 1 and "image" in errors[0].message().lower(), [e.message() for e in errors]
    results = {result.get_response().id: result for result, error in received if error is None}
    assert sorted(results) == sorted(f"r{i}" for i in range(12) if i != 5)
    for result in results.values():
        assert len(json.loads(result.as_numpy("detections")[0])["detections"]) == 1
    assert "Traceback" not in server.log()


def test_a_client_that_closes_its_stream_mid_flight_leaves_the_server_serving(server, client):
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def requests():
            for i in range(8):
                request = service_pb2.ModelInferRequest(model_name="blob", id=f"c{i}")
                request.inputs.add(name="image", datatype="BYTES", shape=[1])
                request.inputs[0].contents.bytes_contents.append(encode(RED_GREEN))
                yield request

        stream = stub.ModelStreamInfer(requests(), timeout=60)
        first = next(stream)
        assert first.infer_response.id.startswith("c") and not first.error_message
        stream.cancel()
    assert client.is_server_ready()
    result = client.infer("blob", [files_input([encode(RED_GREEN)])],
                          outputs=[triton.InferRequestedOutput("detections")])
    assert len(json.loads(result.as_numpy("detections")[0])["detections"]) == 2
    assert "Traceback" not in server.log()


def test_reserved_and_unused_parameters_pass_and_numbers_may_be_strings(stub, client):
    """Triton's C++ client adds triton_-prefixed parameters (tritonclient.grpc refuses to send them itself);
    KServe's gRPC SDK sends numbers as strings."""
    request = service_pb2.ModelInferRequest(model_name="blob")
    request.inputs.add(name="image", datatype="BYTES", shape=[1])
    request.inputs[0].contents.bytes_contents.append(encode(RED_GREEN))
    request.outputs.add(name="detections")
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    request.parameters["threshold"].string_param = "0.5"
    request.parameters["max_detections"].string_param = "1"
    answer = stub.ModelInfer(request, timeout=30)
    detections = json.loads(answer.raw_output_contents[0][4:])
    assert len(detections["detections"]) == 1
    with pytest.raises(InferenceServerException) as refused:
        client.infer("blob", [files_input([encode(RED_GREEN)])], parameters={"threshold": "lots"})
    assert code_of(refused) == "INVALID_ARGUMENT" and "threshold" in refused.value.message()


def test_infer_on_raw_pixels_answers_the_signatures_outputs(client):
    batch = np.stack([RED_GREEN, RED_GREEN[::-1]])
    result = client.infer("blob", [pixels_input(batch)])
    assert result.as_numpy("num_detections").tolist() == [2.0, 2.0]
    boxes, classes, scores = (result.as_numpy(n) for n in OUTPUTS[:3])
    np.testing.assert_allclose(boxes[0, :2], [RED_BOX, GREEN_BOX], atol=1e-6)
    np.testing.assert_allclose(boxes[1, 0], [1 - RED_BOX[2], RED_BOX[1], 1 - RED_BOX[0], RED_BOX[3]], atol=1e-6)
    assert classes[0, :2].tolist() == [1.0, 2.0]
    np.testing.assert_allclose(scores[0, :2], [0.9, 0.6], atol=1e-6)
    assert result.get_response().model_version == "2"


def test_infer_on_jpeg_bytes_answers_detections_as_the_http_route_does(client, server):
    files = [encode(RED_GREEN), encode(BLUE, "JPEG", quality=95)]
    outputs = [triton.InferRequestedOutput("num_detections"), triton.InferRequestedOutput("detections")]
    result = client.infer("blob", [files_input(files)], outputs=outputs, parameters={"threshold": 0.5})
    assert result.as_numpy("num_detections").tolist() == [2.0, 1.0]
    answers = [json.loads(item) for item in result.as_numpy("detections")]
    assert [d["class_id"] for d in answers[0]["detections"]] == [1, 2] and answers[1]["detections"] == []
    _, _, detect = server.request("POST", "/detect?threshold=0.5", files[0], {"Content-Type": "image/png"})
    assert detect["detections"] == answers[0]["detections"]


def test_output_selection_and_max_detections(client):
    result = client.infer("blob", [files_input([encode(RED_GREEN)])], parameters={"max_detections": 1},
                          outputs=[triton.InferRequestedOutput("detections"),
                                   triton.InferRequestedOutput("detection_scores")])
    assert [o.name for o in result.get_response().outputs] == ["detections", "detection_scores"]
    assert len(json.loads(result.as_numpy("detections")[0])["detections"]) == 1


def test_a_version_not_served_and_an_unknown_model_are_not_found(client):
    with pytest.raises(InferenceServerException) as refused:
        client.infer("blob", [pixels_input(RED_GREEN[None])], model_version="1")
    assert code_of(refused) == "NOT_FOUND" and "serves version 2" in refused.value.message()
    with pytest.raises(InferenceServerException) as refused:
        client.get_model_metadata("nope")
    assert code_of(refused) == "NOT_FOUND" and "blob" in refused.value.message()
    with pytest.raises(InferenceServerException) as refused:
        client.is_model_ready("nope")
    assert code_of(refused) == "NOT_FOUND"


def test_the_clients_deadline_is_the_calls_deadline(client):
    with pytest.raises(InferenceServerException) as refused:
        client.infer("blob", [pixels_input(np.zeros((1, 1500, 1500, 3), np.uint8))], client_timeout=0.001)
    assert code_of(refused) == "DEADLINE_EXCEEDED"
    assert client.infer("blob", [pixels_input(RED_GREEN[None])]).as_numpy("num_detections").tolist() == [2.0]


def test_the_repository_index_is_tritons(client):
    index = client.get_model_repository_index(as_json=True)["models"]
    assert [(m["name"], m["version"], m["state"]) for m in index] == [("blob", "2", "READY")]


# The bad-input battery: INVALID_ARGUMENT within a second, the server still serving -------------------------

def _tensor(name="input_tensor", datatype="UINT8", shape=(1, 2, 2, 3)):
    return service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=list(shape))


def _request(*inputs, raw=(), outputs=(), **fields):
    return service_pb2.ModelInferRequest(
        model_name="blob", inputs=list(inputs), raw_input_contents=list(raw),
        outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=n) for n in outputs], **fields)


PIXELS = bytes(12)
BAD_REQUESTS = {
    "raw contents shorter than the shape": (_request(_tensor(), raw=[bytes(11)]), "12 bytes"),
    "raw contents longer than the shape": (_request(_tensor(), raw=[bytes(13)]), "12 bytes"),
    "a datatype that disagrees with the data": (_request(_tensor(datatype="FP32"), raw=[PIXELS]), "48 bytes"),
    "a negative dimension": (_request(_tensor(shape=(1, -2, 2, 3)), raw=[PIXELS]), "at least 1"),
    "a zero dimension": (_request(_tensor(shape=(0, 2, 2, 3)), raw=[b""]), "at least 1"),
    "an enormous dimension": (_request(_tensor(shape=(1, 2**62, 2**62, 3)), raw=[PIXELS]), "bytes"),
    "an enormous BYTES element count": (_request(_tensor("image", "BYTES", (2**40,)), raw=[bytes(8)]), "BYTES"),
    "a BYTES length past the end": (_request(_tensor("image", "BYTES", (1,)), raw=[b"\xff\xff\xff\x7fabc"]),
                                    "past the end"),
    "a duplicated input name": (_request(_tensor(), _tensor(), raw=[PIXELS, PIXELS]), "duplicate input"),
    "a duplicated output name": (_request(_tensor(), raw=[PIXELS], outputs=("num_detections", "num_detections")),
                                 "duplicate output"),
    "raw contents for some inputs only": (_request(_tensor(), _tensor("image", "BYTES", (1,)), raw=[PIXELS]),
                                          "one per input"),
    "no data at all": (_request(_tensor()), "no data"),
    "typed contents of the wrong count": (
        _request(service_pb2.ModelInferRequest.InferInputTensor(
            name="input_tensor", datatype="UINT8", shape=[1, 2, 2, 3],
            contents=service_pb2.InferTensorContents(uint_contents=[1, 2, 3]))), "3"),
    "typed contents out of range": (
        _request(service_pb2.ModelInferRequest.InferInputTensor(
            name="input_tensor", datatype="UINT8", shape=[1, 1, 1, 3],
            contents=service_pb2.InferTensorContents(uint_contents=[1, 2, 300]))), "from 0 to 255"),
    "an unknown datatype": (_request(_tensor(datatype="UINT128"), raw=[PIXELS]), "datatype"),
    "an unknown input": (_request(_tensor("pixels"), raw=[PIXELS]), "unknown input"),
    "an unknown output": (_request(_tensor(), raw=[PIXELS], outputs=("boxes",)), "unknown output"),
    "not an image": (_request(_tensor("image", "BYTES", (1,)), raw=[b"\x03\x00\x00\x00abc"]), "image"),
    "no inputs": (_request(), "no inputs"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_input_is_invalid_argument_within_a_second(stub, client, name):
    request, fragment = BAD_REQUESTS[name]
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request, timeout=10)
    assert time.monotonic() - started < 1.0
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert fragment in refused.value.details()
    assert client.is_server_ready()


def test_a_message_over_max_body_bytes_is_resource_exhausted(stub, client):
    big = bytes(3 * 2**20)  # the shared server's max_body_bytes is 2 MiB
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(_request(_tensor(shape=(1, 1024, 1024, 3)), raw=[big]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.is_server_ready()


# TF Serving's PredictionServiceStub and ModelServiceStub ----------------------------------------------------

@pytest.fixture(scope="module")
def tf_channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield channel


def test_tf_serving_predict_on_pixels(tf_channel):
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "blob"
    request.model_spec.signature_name = "serving_default"
    request.inputs["input_tensor"].CopyFrom(tf.make_tensor_proto(RED_GREEN[None]))
    response = prediction_service_pb2_grpc.PredictionServiceStub(tf_channel).Predict(request, timeout=30)
    assert set(response.outputs) == set(OUTPUTS)
    assert tf.make_ndarray(response.outputs["num_detections"]).tolist() == [2.0]
    np.testing.assert_allclose(tf.make_ndarray(response.outputs["detection_boxes"])[0, :2], [RED_BOX, GREEN_BOX],
                               atol=1e-6)
    assert response.model_spec.name == "blob" and response.model_spec.version.value == 2


def test_tf_serving_predict_on_encoded_images_with_an_output_filter(tf_channel):
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "blob"
    request.inputs["input_tensor"].CopyFrom(tf.make_tensor_proto([encode(RED_GREEN), encode(BLUE)]))
    request.output_filter.append("num_detections")
    response = prediction_service_pb2_grpc.PredictionServiceStub(tf_channel).Predict(request, timeout=30)
    assert list(response.outputs) == ["num_detections"]
    assert tf.make_ndarray(response.outputs["num_detections"]).tolist() == [2.0, 1.0]


@pytest.mark.parametrize("change, code, fragment", [
    (lambda r: setattr(r.model_spec, "name", "nope"), "NOT_FOUND", "blob"),
    (lambda r: r.model_spec.version.__setattr__("value", 1), "NOT_FOUND", "serves version 2"),
    (lambda r: setattr(r.model_spec, "signature_name", "other"), "INVALID_ARGUMENT", "serving_default"),
    (lambda r: r.output_filter.append("boxes"), "INVALID_ARGUMENT", "boxes"),
    (lambda r: r.inputs["extra"].CopyFrom(r.inputs["input_tensor"]), "INVALID_ARGUMENT", "one input"),
    (lambda r: r.inputs["input_tensor"].tensor_shape.dim[1].__setattr__("size", 49), "INVALID_ARGUMENT", "bytes"),
    (lambda r: r.inputs["input_tensor"].tensor_shape.dim[1].__setattr__("size", -1), "INVALID_ARGUMENT", "negative"),
])
def test_tf_serving_refusals(tf_channel, change, code, fragment):
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "blob"
    request.inputs["input_tensor"].CopyFrom(tf.make_tensor_proto(RED_GREEN[None]))
    change(request)
    with pytest.raises(grpc.RpcError) as refused:
        prediction_service_pb2_grpc.PredictionServiceStub(tf_channel).Predict(request, timeout=30)
    assert refused.value.code().name == code and fragment in refused.value.details()


def test_tf_serving_model_status_and_metadata(tf_channel):
    from tensorflow_serving.apis import (get_model_metadata_pb2, get_model_status_pb2, model_service_pb2_grpc,
                                         prediction_service_pb2_grpc)

    status = model_service_pb2_grpc.ModelServiceStub(tf_channel).GetModelStatus(
        get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "blob"}), timeout=30)
    (version,) = status.model_version_status
    assert version.version == 2 and version.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
    request = get_model_metadata_pb2.GetModelMetadataRequest(model_spec={"name": "blob"},
                                                             metadata_field=["signature_def"])
    metadata = prediction_service_pb2_grpc.PredictionServiceStub(tf_channel).GetModelMetadata(request, timeout=30)
    signatures = get_model_metadata_pb2.SignatureDefMap()
    metadata.metadata["signature_def"].Unpack(signatures)
    serving = signatures.signature_def["serving_default"]
    assert set(serving.inputs) == {"input_tensor"} and set(OUTPUTS) <= set(serving.outputs)
    assert metadata.model_spec.version.value == 2


# Health and reflection, with grpcio's own clients -------------------------------------------------------------

def test_health_checks_the_server_each_service_and_each_model(tf_channel):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(tf_channel)
    for name in ("", "liveness", "inference.GRPCInferenceService", "tensorflow.serving.PredictionService", "blob"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, name
    with pytest.raises(grpc.RpcError) as refused:
        health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


def test_reflection_lists_every_service_and_describes_them(tf_channel):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    database = ProtoReflectionDescriptorDatabase(tf_channel)
    services = set(database.get_services())
    assert {"inference.GRPCInferenceService", "tensorflow.serving.PredictionService",
            "tensorflow.serving.ModelService", "grpc.health.v1.Health"} <= services
    pool = DescriptorPool(database)
    infer = pool.FindServiceByName("inference.GRPCInferenceService").FindMethodByName("ModelInfer")
    assert infer.input_type.full_name == "inference.ModelInferRequest"
    predict = pool.FindServiceByName("tensorflow.serving.PredictionService").FindMethodByName("Predict")
    assert "inputs" in predict.input_type.fields_by_name


def test_grpc_calls_are_counted_by_method_and_code(server, client):
    client.is_server_live()
    text = server.request("GET", "/metrics")[2].decode()
    assert 'detect_grpc_requests_total{code="OK",method="/inference.GRPCInferenceService/ServerLive",model=""}' in text
    assert 'code="INVALID_ARGUMENT",method="/inference.GRPCInferenceService/ModelInfer",model="blob"' in text


def test_the_http_process_still_never_loads_tensorflow(server):
    assert "libtensorflow" not in Path(f"/proc/{server.process.pid}/maps").read_text()


# The status table ---------------------------------------------------------------------------------------------

def test_every_request_error_has_a_grpc_status_and_bad_input_is_invalid_argument():
    from app import errors

    codes = {cls: errors.grpc_status(cls("")) for cls in errors.request_errors()}
    assert all(code in grpc.StatusCode.__members__ for code in codes.values()), codes
    for cls in (errors.InvalidBody, errors.InvalidParameter, errors.InvalidImage, errors.ImageTooLarge,
                errors.UnsupportedImageFormat):
        assert codes[cls] == "INVALID_ARGUMENT", cls
    assert (codes[errors.ModelNotFound], codes[errors.VersionNotFound]) == ("NOT_FOUND", "NOT_FOUND")
    assert (codes[errors.ModelUnavailable], codes[errors.NotReady]) == ("UNAVAILABLE", "UNAVAILABLE")
    assert (codes[errors.Overloaded], codes[errors.BodyTooLarge]) == ("RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED")
    assert codes[errors.DeadlineExceeded] == "DEADLINE_EXCEEDED" and codes[errors.Forbidden] == "PERMISSION_DENIED"


@pytest.mark.parametrize("peer, host", [("ipv4:127.0.0.1:5000", "127.0.0.1"), ("ipv6:[::1]:5000", "::1"),
                                        ("ipv6:%5B::1%5D:5000", "::1"), ("unix:/tmp/s", None)])
def test_the_peer_address_is_read_for_the_loopback_rule(peer, host):
    from app.grpc.calls import peer_host

    assert peer_host(peer) == host
