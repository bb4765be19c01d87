"""The gRPC port's guarantees against real servers: TLS from the HTTPS settings, restricted_api on call
metadata, the repository extension, TF Serving on an encoded-image export, overload at 256 concurrent calls,
SIGTERM with calls in flight, and a worker killed with kill -9 under gRPC load."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from blob_model import blob_image, build_blob_model
from conftest import gauge, start_server, wait_for
from images_for_tests import encode

IMAGE = blob_image(64, 48, {1: (10, 5, 20, 15), 2: (30, 20, 50, 40)})


def pixels_input(array: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("input_tensor", list(array.shape), "UINT8")
    tensor.set_data_from_numpy(array)
    return tensor


def infer_request(model: str, pixels: np.ndarray = IMAGE) -> service_pb2.ModelInferRequest:
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name="input_tensor", datatype="UINT8",
                                                             shape=[1, *pixels.shape])
    return service_pb2.ModelInferRequest(model_name=model, inputs=[tensor], raw_input_contents=[pixels.tobytes()],
                                         outputs=[{"name": "num_detections"}])


def code_of(refused) -> str:
    return str(refused.value.status()).rsplit(".", 1)[-1]


def test_tls_restricted_api_on_metadata_the_repository_and_an_encoded_image_export(tmp_path, blob_model_dir):
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
    from test_security import _self_signed

    pytest.importorskip("OpenSSL", reason="the server's HTTPS needs the tls extra (pyOpenSSL)")
    repository = tmp_path / "repo"
    repository.mkdir()
    (repository / "blob").symlink_to(blob_model_dir)
    build_blob_model(repository / "jpegs" / "1", input_type="encoded_image_string_tensor")
    cert_file, key_file = _self_signed(tmp_path)
    server = start_server({
        "DETECT_MODEL_REPOSITORY": str(repository), "DETECT_SPARE_WORKERS": "0", "DETECT_IDLE_UNLOAD_S": "0",
        "DETECT_TLS_CERT_FILE": str(cert_file), "DETECT_TLS_KEY_FILE": str(key_file),
        "DETECT_RESTRICTED_API": "inference:infer-key=open-sesame;model-repository:admin-key=s3cret",
    }, tmp_path / "server.log")
    url = f"localhost:{server.grpc_port}"
    try:
        with triton.InferenceServerClient(url, ssl=True, root_certificates=str(cert_file)) as client:
            assert client.is_server_ready()  # health is not restricted
            with pytest.raises(InferenceServerException) as refused:
                client.infer("blob", [pixels_input(IMAGE[None])])
            assert code_of(refused) == "PERMISSION_DENIED" and "infer-key" in refused.value.message()
            assert "open-sesame" not in refused.value.message()
            with pytest.raises(InferenceServerException) as refused:
                client.infer("blob", [pixels_input(IMAGE[None])], headers={"infer-key": "wrong"})
            assert code_of(refused) == "PERMISSION_DENIED"
            key = {"infer-key": "open-sesame"}
            assert client.infer("blob", [pixels_input(IMAGE[None])], headers=key).as_numpy(
                "num_detections").tolist() == [2.0]

            with pytest.raises(InferenceServerException) as refused:
                client.unload_model("blob")
            assert code_of(refused) == "PERMISSION_DENIED"
            admin = {"admin-key": "s3cret"}
            client.unload_model("blob", headers=admin)
            wait_for(lambda: not client.is_model_ready("blob"), 30, "the unload")
            with pytest.raises(InferenceServerException) as refused:
                client.infer("blob", [pixels_input(IMAGE[None])], headers=key)
            assert code_of(refused) == "UNAVAILABLE"
            index = {m["name"]: m["state"] for m in client.get_model_repository_index(headers=admin, as_json=True)["models"]}
            assert index == {"blob": "UNAVAILABLE", "jpegs": "READY"}
            client.load_model("blob", headers=admin)
            assert client.is_model_ready("blob")
            assert client.infer("blob", [pixels_input(IMAGE[None])], headers=key).as_numpy(
                "num_detections").tolist() == [2.0]

        credentials = grpc.ssl_channel_credentials(cert_file.read_bytes())
        with grpc.secure_channel(url, credentials) as channel:
            request = predict_pb2.PredictRequest()
            request.model_spec.name = "jpegs"
            request.inputs["input_tensor"].CopyFrom(tf.make_tensor_proto([encode(IMAGE)]))
            response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                request, timeout=30, metadata=[("infer-key", "open-sesame")])
            assert tf.make_ndarray(response.outputs["num_detections"]).tolist() == [2.0]
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as plain:
            with pytest.raises(grpc.RpcError):
                service_pb2_grpc.GRPCInferenceServiceStub(plain).ServerLive(service_pb2.ServerLiveRequest(), timeout=5)
    finally:
        assert server.stop() == 0
    assert "with TLS" in server.log()


def test_256_concurrent_calls_get_ok_or_an_immediate_refusal_then_sigterm_lets_calls_in_flight_finish(
        tmp_path, slow_blob_model_dir):
    server = start_server({
        "DETECT_MODEL": str(slow_blob_model_dir), "DETECT_HTTP_THREADS": "8", "DETECT_MAX_QUEUE": "8",
        "DETECT_INFERENCE_THREADS": "1", "DETECT_SPARE_WORKERS": "0", "DETECT_SHUTDOWN_GRACE_S": "30",
    }, tmp_path / "server.log")
    small = IMAGE[:8, :8]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

            def call(_):
                started = time.monotonic()
                try:
                    stub.ModelInfer(infer_request("slowblob", small), timeout=120)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                return code, time.monotonic() - started

            with ThreadPoolExecutor(256) as pool:
                outcomes = list(pool.map(call, range(256)))
            codes = Counter(code for code, _ in outcomes)
            print(f"256 concurrent calls: {dict(codes)}; slowest refusal "
                  f"{max((s for c, s in outcomes if c != 'OK'), default=0):.2f} s")
            assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}, codes
            assert codes["OK"] >= 8 and codes["RESOURCE_EXHAUSTED"] > 0, codes
            refused = [seconds for code, seconds in outcomes if code != "OK"]
            assert max(refused) < 5.0, "a refusal waited"

            # SIGTERM with calls in flight: they finish; a new call is refused; the process exits 0.
            with ThreadPoolExecutor(4) as pool:
                in_flight = [pool.submit(call, i) for i in range(4)]
                wait_for(lambda: _grpc_in_flight(server) >= 4, 30, "4 calls in flight", server.log_path)
                server.process.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                late, _ = call(0)
                assert late in ("UNAVAILABLE",), late
                assert [f.result()[0] for f in in_flight] == ["OK"] * 4
        assert server.process.wait(60) == 0
    finally:
        server.stop()
    assert "Traceback" not in server.log()


def _grpc_in_flight(server) -> int:
    return gauge(server, "detect_grpc_inference_calls_in_flight")


CALLERS = 16
KILLS = 5


def test_five_kills_of_a_worker_under_16_concurrent_grpc_callers_leave_every_call_answered(tmp_path, blob_model_dir):
    """As tests/test_crash_isolation.py does for HTTP, smaller: a call on a dead worker runs again on its successor."""
    repository = tmp_path / "repo"
    repository.mkdir()
    (repository / "alpha").symlink_to(blob_model_dir)
    server = start_server({
        "DETECT_MODEL_REPOSITORY": str(repository), "DETECT_RESTART_BACKOFF_S": "0.05",
        "DETECT_MAX_FAILURES": "1000", "DETECT_FAILURE_WINDOW_S": "1", "DETECT_SPARE_WORKERS": "2",
        "DETECT_IDLE_UNLOAD_S": "0", "DETECT_INFERENCE_THREADS": "4",
    }, tmp_path / "server.log")
    outcomes: list[tuple[str, str]] = []
    lock, stop = threading.Lock(), threading.Event()

    def caller():
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            while not stop.is_set():
                try:
                    stub.ModelInfer(infer_request("alpha"), timeout=60)
                    outcome = ("OK", "")
                except grpc.RpcError as exc:
                    outcome = (exc.code().name, exc.details() or "")
                with lock:
                    outcomes.append(outcome)

    def worker_pid():
        status, _, body = server.request("GET", "/models/alpha")
        return body["pid"] if status == 200 and body["state"] == "ready" else None

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(CALLERS)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: len(outcomes) > 2 * CALLERS, 60, "answers before the first kill", server.log_path)
        killed: list[int] = []
        while len(killed) < KILLS:
            pid = wait_for(lambda: (p := worker_pid()) not in (None, *killed) and p, 60,
                           f"a successor after {len(killed)} kills", server.log_path)
            seen = len(outcomes)
            wait_for(lambda: len(outcomes) > seen + 3, 60, "answers from the successor", server.log_path)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        wait_for(lambda: (p := worker_pid()) not in (None, *killed) and p, 60, "the last successor")
        seen = len(outcomes)
        wait_for(lambda: len(outcomes) > seen + CALLERS, 60, "answers after the last kill", server.log_path)
        stop.set()
        for thread in threads:
            thread.join(60)
        assert server.process.poll() is None
        codes = Counter(code for code, _ in outcomes)
        print(f"{KILLS} kills under {CALLERS} callers: {dict(codes)}")
        # As on HTTP: every call OK, but for the documented UNAVAILABLE of a model whose worker is restarting.
        others = [(code, details) for code, details in outcomes
                  if code != "OK" and not (code == "UNAVAILABLE" and "unavailable" in details)]
        assert others == [], codes
        assert codes["OK"] > 3 * CALLERS, codes
    finally:
        stop.set()
        assert server.stop() == 0
    assert server.log().count("was killed by SIGKILL") >= KILLS
    assert "Traceback" not in server.log()


def test_open_streams_are_capped_so_unary_calls_and_health_keep_their_threads(tmp_path, blob_model_dir):
    """With max_streams 2, at most 2 streams are open at once: a third is refused at once (RESOURCE_EXHAUSTED),
    unary calls and liveness still answer, and once a stream closes a new one is let in. Each stream's requests
    are counted as calls of ModelStreamInfer."""
    import queue

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = start_server({"DETECT_MODEL": str(blob_model_dir), "DETECT_HTTP_THREADS": "4", "DETECT_MAX_STREAMS": "2",
                           "DETECT_SPARE_WORKERS": "0"}, tmp_path / "server.log")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            feeds = [queue.SimpleQueue() for _ in range(3)]

            def requests(feed):
                while (request := feed.get()) is not None:
                    yield request

            streams = [stub.ModelStreamInfer(requests(feed), timeout=60) for feed in feeds[:2]]
            for feed, stream in zip(feeds, streams):  # both open and answering
                feed.put(infer_request("blob"))
                assert not next(stream).error_message
            third = stub.ModelStreamInfer(requests(feeds[2]), timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                next(third)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "streams are open" in refused.value.details()
            assert stub.ModelInfer(infer_request("blob"), timeout=30).outputs[0].name == "num_detections"
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
            feeds[0].put(None)  # the client ends its first stream
            assert list(streams[0]) == []

            def let_in():
                feed = queue.SimpleQueue()
                feed.put(infer_request("blob"))
                feed.put(None)
                try:
                    return [not a.error_message for a in stub.ModelStreamInfer(requests(feed), timeout=30)]
                except grpc.RpcError:
                    return None

            assert wait_for(let_in, 10, "a new stream let in once one closed") == [True]
            feeds[1].put(None)
            list(streams[1])
        metrics = server.request("GET", "/metrics")[2].decode()
        assert 'detect_grpc_requests_total{code="OK",method="/inference.GRPCInferenceService/ModelStreamInfer",' \
               'model="blob"}' in metrics
    finally:
        assert server.stop() == 0
