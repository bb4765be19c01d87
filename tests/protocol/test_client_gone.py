"""Work for a client that has gone never reaches the model: dozens of requests queued behind a slow model, most of
whose clients then hang up (HTTP), cancel (gRPC) or close their stream, are taken out of the queue at once and
counted (detect_dropped_images_total); the model runs only what someone still waits for. Before, every one of them
ran in the model after its client had gone."""

from __future__ import annotations

import queue
import socket
import time

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from blob_model import blob_image, build_blob_model
from conftest import gauge, start_server, wait_for
from images_for_tests import encode

IMAGE = blob_image(32, 24, {1: (4, 4, 12, 12)})
QUEUED, GONE = 32, 24


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    """One model call at a time, a second or more each, eight images a call: a queue that holds what waits."""
    base = tmp_path_factory.mktemp("gone")
    build_blob_model(base / "slow" / "1", busy_products=900)
    server = start_server({"DETECT_MODEL": str(base / "slow"), "DETECT_INFERENCE_THREADS": "1",
                           "DETECT_MAX_BATCH_SIZE": "8", "DETECT_HTTP_THREADS": "64", "DETECT_IDLE_UNLOAD_S": "0",
                           "DETECT_SPARE_WORKERS": "0"}, base / "server.log")
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.log()


def dropped(server) -> int:
    text = server.request("GET", "/metrics")[2].decode()
    prefix = 'detect_dropped_images_total{model="slow"} '
    return int(float(next((line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)), "0")))


def images_run(server) -> int:
    return server.request("GET", "/v2/models/slow/stats")[2]["model_stats"][0]["inference_count"]


def depth(server) -> int:
    return gauge(server, 'detect_queue_depth{model="slow"}')


def raw_request(port: int, body: bytes) -> socket.socket:
    """Send one whole POST /detect on a connection of its own, and leave the answer unread."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /detect HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def read_status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


def settle(server, want_depth: int) -> None:
    wait_for(lambda: depth(server) == want_depth, 30, f"{want_depth} images queued")


def test_http_requests_whose_connections_close_are_dropped_from_the_queue(slow_server):
    body = encode(IMAGE, "PNG")
    dropped_before, ran_before = dropped(slow_server), images_run(slow_server)
    blocker = raw_request(slow_server.port, body)
    wait_for(lambda: gauge(slow_server, "detect_http_requests_in_flight") >= 2, 30, "the first request in the model")
    waiting = [raw_request(slow_server.port, body) for _ in range(QUEUED)]
    settle(slow_server, QUEUED)
    for sock in waiting[:GONE]:
        sock.close()  # the client hangs up
    wait_for(lambda: dropped(slow_server) - dropped_before == GONE, 30, f"{GONE} images dropped")
    assert [read_status(sock) for sock in [blocker, *waiting[GONE:]]] == [200] * (1 + QUEUED - GONE)
    for sock in [blocker, *waiting[GONE:]]:
        sock.close()
    assert images_run(slow_server) - ran_before == 1 + QUEUED - GONE
    text = slow_server.request("GET", "/metrics")[2].decode()
    assert f'detect_http_requests_total{{model="slow",route="/detect",status="499"}} {float(GONE)}' in text


def infer_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="slow")
    request.inputs.add(name="input_tensor", datatype="UINT8", shape=[1, *IMAGE.shape])
    request.raw_input_contents.append(IMAGE.tobytes())
    return request


def test_grpc_calls_that_are_cancelled_are_dropped_from_the_queue(slow_server):
    dropped_before, ran_before = dropped(slow_server), images_run(slow_server)
    with grpc.insecure_channel(f"127.0.0.1:{slow_server.grpc_port}") as channel:
        infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        blocker = infer.future(infer_request(), timeout=60)
        wait_for(lambda: gauge(slow_server, "detect_grpc_inference_calls_in_flight") == 1, 30, "the first call")
        waiting = [infer.future(infer_request(), timeout=60) for _ in range(QUEUED)]
        settle(slow_server, QUEUED)
        for call in waiting[:GONE]:
            call.cancel()
        wait_for(lambda: dropped(slow_server) - dropped_before == GONE, 30, f"{GONE} images dropped")
        answers = [call.result() for call in [blocker, *waiting[GONE:]]]
    assert all(answer.outputs for answer in answers)
    assert images_run(slow_server) - ran_before == 1 + QUEUED - GONE
    text = slow_server.request("GET", "/metrics")[2].decode()
    assert 'code="CANCELLED",method="/inference.GRPCInferenceService/ModelInfer",model="slow"}' in text


def test_a_stream_that_closes_drops_what_its_requests_still_have_queued(slow_server):
    dropped_before, ran_before = dropped(slow_server), images_run(slow_server)
    with grpc.insecure_channel(f"127.0.0.1:{slow_server.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        blocker = stub.ModelInfer.future(infer_request(), timeout=60)
        wait_for(lambda: gauge(slow_server, "detect_grpc_inference_calls_in_flight") == 1, 30, "the first call")
        feed: queue.SimpleQueue = queue.SimpleQueue()
        stream = stub.ModelStreamInfer(iter(feed.get, None))
        for _ in range(QUEUED):
            feed.put(infer_request())
        settle(slow_server, QUEUED)
        stream.cancel()
        feed.put(None)
        wait_for(lambda: dropped(slow_server) - dropped_before == QUEUED, 30, f"{QUEUED} images dropped")
        assert blocker.result().outputs
    time.sleep(0.5)
    assert images_run(slow_server) - ran_before == 1
