"""Calls a client can hold open, attacked as a client would hold them: idle health Watch streams, idle reflection
streams and idle inference streams, on real servers over real gRPC.

Before the one admission rule, about 140 idle Watch or reflection streams filled gRPC's concurrent-call limit
(http_threads + 4), and the liveness probe, ServerLive and every inference call then answered RESOURCE_EXHAUSTED
for as long as they were held; streams never ended. Now each kind has its cap, past it the one more is refused at
once, probes run on threads nothing else takes, and a held call that moves nothing for idle_timeout_s is ended.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from blob_model import blob_image, build_blob_model
from conftest import gauge, http_request, start_server, wait_for

REFLECTION_CAP = 8  # reflection streams open at once, as the docs give it (app/protocol/admission.py)
PROBE_TIMEOUT_S = 3.0  # the Helm chart's readiness probe timeout, the shortest of its probes'
IMAGE = blob_image(32, 24, {1: (4, 4, 12, 12)})
HTTP_PROBES = ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready")


def infer_request(model: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="input_tensor", datatype="UINT8", shape=[1, *IMAGE.shape])
    request.raw_input_contents.append(IMAGE.tobytes())
    return request


def feed_of(items: queue.SimpleQueue):
    """A request stream the test feeds by hand; None ends it."""
    while (item := items.get()) is not None:
        yield item


def code_of(call) -> grpc.StatusCode:
    try:
        next(call)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def probes_answer(server) -> dict:
    """Ask every probe of both doors, each with the probe timeout; return what each answered and how fast."""
    answers = {}
    for path in HTTP_PROBES:
        started = time.monotonic()
        status, _, _ = http_request(server.port, "GET", path, timeout=PROBE_TIMEOUT_S)
        answers[path] = (status, time.monotonic() - started)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for name, ask in (
            ("Check(liveness)", lambda: health.Check(health_pb2.HealthCheckRequest(service="liveness"),
                                                     timeout=PROBE_TIMEOUT_S).status == health_pb2.HealthCheckResponse.SERVING),
            ("Check()", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S).status
             == health_pb2.HealthCheckResponse.SERVING),
            ("ServerLive", lambda: kserve.ServerLive(service_pb2.ServerLiveRequest(), timeout=PROBE_TIMEOUT_S).live),
            ("ServerReady", lambda: kserve.ServerReady(service_pb2.ServerReadyRequest(),
                                                       timeout=PROBE_TIMEOUT_S).ready),
        ):
            started = time.monotonic()
            try:
                answer = ask()
            except grpc.RpcError as error:
                answer = error.code().name
            answers[name] = (answer, time.monotonic() - started)
    return answers


def cancel_and_count_out(server, kind: str, calls: list) -> None:
    """Every one of `calls` (open, of `kind`) is counted open; cancelled by the client, each is counted out."""
    series = f'detect_open_calls{{door="grpc",kind="{kind}"}}'
    assert gauge(server, series) == len(calls)
    for call in calls:
        call.cancel()
    wait_for(lambda: gauge(server, series) == 0, 10, f"every cancelled {kind} call counted out")


def assert_probes_answer(server) -> None:
    answers = probes_answer(server)
    wrong = {name: answer for name, answer in answers.items() if answer[0] not in (200, True)}
    assert not wrong, f"probes that did not answer within {PROBE_TIMEOUT_S} s: {wrong}"


@pytest.fixture(scope="module")
def default_server(blob_model_dir, tmp_path_factory):
    """A server with the default caps and threads (http_threads 128), as the attack found it."""
    server = start_server({"DETECT_MODEL": str(blob_model_dir), "DETECT_IDLE_UNLOAD_S": "0",
                           "DETECT_SPARE_WORKERS": "0"}, tmp_path_factory.mktemp("held") / "server.log")
    yield server
    assert server.stop() == 0


def open_watches(channels, count: int, service: str = "") -> list:
    """Open `count` Watch calls spread over `channels`; return them once each has answered its first status."""
    calls = [health_pb2_grpc.HealthStub(channels[i % len(channels)]).Watch(
        health_pb2.HealthCheckRequest(service=service)) for i in range(count)]
    return calls


def test_140_idle_watch_streams_leave_liveness_inference_and_new_calls_answering(default_server):
    channels = [grpc.insecure_channel(f"127.0.0.1:{default_server.grpc_port}") for _ in range(4)]
    try:
        watches = open_watches(channels, 140)
        first = [next(call).status for call in watches]
        assert first == [health_pb2.HealthCheckResponse.SERVING] * 140  # every one admitted: a Watch holds no thread
        assert_probes_answer(default_server)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channels[0])
        assert "num_detections" in {o.name for o in stub.ModelInfer(infer_request("blob"), timeout=30).outputs}
        cancel_and_count_out(default_server, "watch", watches)
    finally:
        for channel in channels:
            channel.close()


def test_idle_reflection_streams_past_their_cap_are_refused_at_once_and_probes_still_answer(default_server):
    channel = grpc.insecure_channel(f"127.0.0.1:{default_server.grpc_port}")
    feeds = [queue.SimpleQueue() for _ in range(140)]
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        calls = [stub.ServerReflectionInfo(feed_of(feed)) for feed in feeds]
        for feed in feeds:
            feed.put(reflection_pb2.ServerReflectionRequest(list_services=""))
        started = time.monotonic()
        codes = []
        for call in calls:
            try:
                answer = next(call)
                codes.append("OK" if answer.list_services_response.service else "EMPTY")
            except grpc.RpcError as error:
                codes.append(error.code().name)
                assert "reflection streams are open" in error.details()
        assert codes.count("OK") == REFLECTION_CAP and codes.count("RESOURCE_EXHAUSTED") == 140 - REFLECTION_CAP
        assert time.monotonic() - started < 30  # refused at once, not queued behind the held ones
        assert_probes_answer(default_server)
    finally:
        for feed in feeds:
            feed.put(None)
        channel.close()


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory):
    """A detector that takes a second or more per call: inference calls stay in flight while probes are asked."""
    return build_blob_model(tmp_path_factory.mktemp("models") / "slow" / "1", busy_products=600)


def test_every_kind_of_open_call_held_at_its_cap_leaves_every_probe_answering(slow_model_dir, tmp_path):
    """Watches, reflection streams, inference streams and inference calls over both doors, each at its cap: the
    probes of both doors answer within the probe timeout, and one more call of each kind is refused at once."""
    server = start_server({"DETECT_MODEL": str(slow_model_dir), "DETECT_HTTP_THREADS": "4", "DETECT_MAX_STREAMS": "2",
                           "DETECT_MAX_WATCHES": "3", "DETECT_INFERENCE_THREADS": "1", "DETECT_MAX_BATCH_SIZE": "1",
                           "DETECT_IDLE_UNLOAD_S": "0", "DETECT_SPARE_WORKERS": "0"}, tmp_path / "server.log")
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    feeds: list[queue.SimpleQueue] = []
    pool = ThreadPoolExecutor(16)
    try:
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        watches = open_watches([channel], 3)
        assert [next(call).status for call in watches] == [health_pb2.HealthCheckResponse.SERVING] * 3
        reflecting = reflection_pb2_grpc.ServerReflectionStub(channel)
        reflections = []  # kept: a call object the client drops is cancelled
        for _ in range(REFLECTION_CAP):
            feeds.append(feed := queue.SimpleQueue())
            reflections.append(reflecting.ServerReflectionInfo(feed_of(feed)))
            feed.put(reflection_pb2.ServerReflectionRequest(list_services=""))
            assert next(reflections[-1]).list_services_response.service
        streams = []
        for _ in range(2):
            feeds.append(feed := queue.SimpleQueue())
            streams.append(kserve.ModelStreamInfer(feed_of(feed)))
            feed.put(infer_request("slow"))
            assert not next(streams[-1]).error_message
        body = _jpeg()
        held = [pool.submit(kserve.ModelInfer, infer_request("slow"), timeout=60) for _ in range(4)]
        held += [pool.submit(http_request, server.port, "POST", "/detect", body, {"Content-Type": "image/jpeg"})
                 for _ in range(4)]
        wait_for(lambda: gauge(server, "detect_grpc_inference_calls_in_flight") == 4, 20, "4 gRPC calls in flight")
        wait_for(lambda: gauge(server, "detect_http_requests_in_flight") >= 5, 20, "4 HTTP requests in flight")

        assert_probes_answer(server)
        # One more of each kind: refused at once, naming its limit.
        assert code_of(open_watches([channel], 1)[0]) == grpc.StatusCode.RESOURCE_EXHAUSTED
        extra = queue.SimpleQueue()
        feeds.append(extra)
        extra.put(reflection_pb2.ServerReflectionRequest(list_services=""))
        assert code_of(reflecting.ServerReflectionInfo(feed_of(extra))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert code_of(kserve.ModelStreamInfer(iter([infer_request("slow")]))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as refused:
            kserve.ModelInfer(infer_request("slow"), timeout=PROBE_TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "http_threads" in refused.value.details()
        status, _, answer = http_request(server.port, "POST", "/detect", body, {"Content-Type": "image/jpeg"},
                                         timeout=PROBE_TIMEOUT_S)
        assert status == 503 and "http_threads" in answer["error"]["message"]
        assert all(f.result(timeout=120) for f in held)  # the admitted ones are all answered
    finally:
        for feed in feeds:
            feed.put(None)
        channel.close()
        pool.shutdown(wait=False, cancel_futures=True)
        assert server.stop() == 0
    assert "Traceback" not in server.log()


def _jpeg() -> bytes:
    from images_for_tests import encode

    return encode(IMAGE, "JPEG")


def test_held_calls_that_move_nothing_are_ended_after_idle_timeout_and_give_their_place_back(blob_model_dir, tmp_path):
    """With idle_timeout_s 2 and max_streams 1: an idle inference stream, reflection stream and Watch each end
    with UNAVAILABLE naming idle_timeout_s, and the one stream's place is free again; a stream whose request is
    still with the model is busy, not idle, and is not ended."""
    build_blob_model(tmp_path / "slowish" / "1", busy_products=1200)
    server = start_server({"DETECT_MODEL": str(tmp_path / "slowish"), "DETECT_IDLE_TIMEOUT_S": "2",
                           "DETECT_MAX_STREAMS": "1", "DETECT_IDLE_UNLOAD_S": "0", "DETECT_SPARE_WORKERS": "0"},
                          tmp_path / "server.log")
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    feeds = [queue.SimpleQueue() for _ in range(3)]
    try:
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stream = kserve.ModelStreamInfer(feed_of(feeds[0]))
        feeds[0].put(infer_request("slowish"))
        assert not next(stream).error_message
        reflecting = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(feed_of(feeds[1]))
        feeds[1].put(reflection_pb2.ServerReflectionRequest(list_services=""))
        assert next(reflecting).list_services_response.service
        watch = open_watches([channel], 1)[0]
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        ended = {}
        for name, call in (("stream", stream), ("reflection", reflecting), ("watch", watch)):
            with pytest.raises(grpc.RpcError) as idle:
                next(call)
            ended[name] = (idle.value.code(), time.monotonic() - started)
            assert "idle_timeout_s" in idle.value.details()
        assert {name: code for name, (code, _) in ended.items()} == dict.fromkeys(ended, grpc.StatusCode.UNAVAILABLE)
        assert all(1.0 < seconds < 10.0 for _, seconds in ended.values()), ended

        # The place is free again; a request that keeps the model busy longer than idle_timeout_s is not idle.
        busy = kserve.ModelStreamInfer(feed_of(feeds[2]))
        feeds[2].put(infer_request("slowish"))
        feeds[2].put(infer_request("slowish"))
        answers = [next(busy), next(busy)]
        assert [a.error_message for a in answers] == ["", ""]
        assert all(a.infer_response.outputs for a in answers)
        text = server.request("GET", "/metrics")[2].decode()
        for kind in ("stream", "reflection", "watch"):
            assert f'detect_idle_calls_ended_total{{door="grpc",kind="{kind}"}} 1.0' in text, kind
    finally:
        for feed in feeds:
            feed.put(None)
        channel.close()
        assert server.stop() == 0
    assert "Traceback" not in server.log()


def test_a_drain_ends_open_watches_at_once_instead_of_waiting_out_the_grace(blob_model_dir, tmp_path):
    server = start_server({"DETECT_MODEL": str(blob_model_dir), "DETECT_SHUTDOWN_GRACE_S": "30",
                           "DETECT_SPARE_WORKERS": "0"}, tmp_path / "server.log")
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        watches = open_watches([channel], 5)
        assert [next(call).status for call in watches] == [health_pb2.HealthCheckResponse.SERVING] * 5
        started = time.monotonic()
        stopped = threading.Thread(target=server.stop)
        stopped.start()
        codes = [code_of(call) for call in watches]
        stopped.join(60)
    assert set(codes) <= {grpc.StatusCode.UNAVAILABLE}, codes
    assert time.monotonic() - started < 20, "the drain waited for the Watch calls"
    assert server.process.returncode == 0


def test_cancelled_streams_leave_nothing_counted(default_server):
    """Streams a client cancels mid-way, dozens at once, count out: the server holds no place for them."""
    channel = grpc.insecure_channel(f"127.0.0.1:{default_server.grpc_port}")
    try:
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        feeds = [queue.SimpleQueue() for _ in range(32)]
        streams = [kserve.ModelStreamInfer(feed_of(feed)) for feed in feeds]
        for feed in feeds:
            feed.put(infer_request("blob"))
        assert all(not next(stream).error_message for stream in streams)
        cancel_and_count_out(default_server, "stream", streams)
    finally:
        for feed in feeds:
            feed.put(None)
        channel.close()
