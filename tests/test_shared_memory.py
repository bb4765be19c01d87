"""Triton's system shared-memory extension, driven by tritonclient's own shared-memory module over HTTP and gRPC:
inputs read from a region and outputs written into one give the answers the same request gets as bytes, every bad
registration or use is a 400 / INVALID_ARGUMENT naming it, and an unregistered region leaves the server's open
files; a region whose object shrinks under the server is a 400, never a crash."""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from blob_model import blob_image

RED_GREEN = blob_image(64, 48, {1: (10, 5, 20, 15), 2: (30, 20, 50, 40)})
OUTPUTS = ("detection_boxes", "detection_classes", "detection_scores", "num_detections")
OUTPUT_ROOM = 64 * 1024  # each output's share of the output region: far more than 2 images' detections need


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    if request.param == "http":
        with triton_http.InferenceServerClient(f"127.0.0.1:{server.port}") as http_client:
            yield triton_http, http_client
    else:
        with triton_grpc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as grpc_client:
            yield triton_grpc, grpc_client


@pytest.fixture
def regions():
    """Create POSIX shared-memory objects for a test and destroy them afterwards."""
    made = []

    def make(size: int):
        key = f"/detect-test-{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key.strip("/"), key, size)
        made.append(handle)
        return key, handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def mapped_keys(server) -> str:
    """What the server process holds of /dev/shm: its open files and its memory maps, one per line."""
    pid = server.process.pid
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    with open(f"/proc/{pid}/maps") as maps:
        return "\n".join(held) + maps.read()


def test_inputs_and_outputs_through_shared_memory_match_the_same_request_as_bytes(client, server, regions):
    kind, triton = client
    batch = np.stack([RED_GREEN, RED_GREEN[::-1]])
    in_key, in_handle = regions(batch.nbytes)
    out_key, out_handle = regions(OUTPUT_ROOM * len(OUTPUTS))
    shm.set_shared_memory_region(in_handle, [batch])
    triton.register_system_shared_memory("in", in_key, batch.nbytes)
    triton.register_system_shared_memory("out", out_key, OUTPUT_ROOM * len(OUTPUTS))
    try:
        status = triton.get_system_shared_memory_status()
        names = {r["name"] for r in status} if kind is triton_http else set(status.regions)
        assert names == {"in", "out"}
        placed_input = kind.InferInput("input_tensor", list(batch.shape), "UINT8")
        placed_input.set_shared_memory("in", batch.nbytes)
        outputs = []
        for i, name in enumerate(OUTPUTS):
            output = kind.InferRequestedOutput(name)
            output.set_shared_memory("out", OUTPUT_ROOM, offset=i * OUTPUT_ROOM)
            outputs.append(output)
        placed = triton.infer("blob", [placed_input], outputs=outputs)
        carried_input = kind.InferInput("input_tensor", list(batch.shape), "UINT8")
        carried_input.set_data_from_numpy(batch)
        carried = triton.infer("blob", [carried_input], outputs=[kind.InferRequestedOutput(n) for n in OUTPUTS])
        for i, name in enumerate(OUTPUTS):
            expected = carried.as_numpy(name)
            answer = placed.get_output(name)
            region = answer["parameters"] if kind is triton_http else {
                k: v.string_param or v.int64_param for k, v in answer.parameters.items()}
            assert region["shared_memory_region"] == "out" and region["shared_memory_byte_size"] == expected.nbytes
            read = shm.get_contents_as_numpy(out_handle, np.float32, expected.shape, offset=i * OUTPUT_ROOM)
            np.testing.assert_array_equal(read, expected)
    finally:
        triton.unregister_system_shared_memory()
    assert in_key.strip("/") not in mapped_keys(server) and out_key.strip("/") not in mapped_keys(server)


def test_the_detections_output_goes_into_shared_memory_too(client, regions):
    kind, triton = client
    in_key, in_handle = regions(RED_GREEN[None].nbytes)
    out_key, out_handle = regions(4096)
    shm.set_shared_memory_region(in_handle, [RED_GREEN[None]])
    triton.register_system_shared_memory("in", in_key, RED_GREEN[None].nbytes)
    triton.register_system_shared_memory("out", out_key, 4096)
    try:
        placed_input = kind.InferInput("input_tensor", [1, *RED_GREEN.shape], "UINT8")
        placed_input.set_shared_memory("in", RED_GREEN[None].nbytes)
        output = kind.InferRequestedOutput("detections")
        output.set_shared_memory("out", 4096)
        answer = triton.infer("blob", [placed_input], outputs=[output]).get_output("detections")
        size = answer["parameters"]["shared_memory_byte_size"] if kind is triton_http else \
            answer.parameters["shared_memory_byte_size"].int64_param
        (text,) = shm.get_contents_as_numpy(out_handle, np.object_, [1])
        assert size == 4 + len(text) and len(json.loads(text)["detections"]) == 2
    finally:
        triton.unregister_system_shared_memory()


def refusal(call) -> str:
    with pytest.raises(InferenceServerException) as refused:
        call()
    return refused.value.message()


def test_bad_registrations_and_uses_are_refused_naming_what_is_wrong(client, server, regions):
    kind, triton = client
    key, handle = regions(1024)
    assert "no shared-memory object" in refusal(lambda: triton.register_system_shared_memory("r", "/no-such-key", 8))
    assert "past the end" in refusal(lambda: triton.register_system_shared_memory("r", key, 1024, offset=8))
    assert "POSIX shared-memory name" in refusal(
        lambda: triton.register_system_shared_memory("r", "/../etc/passwd", 8))
    triton.register_system_shared_memory("r", key, 1024)
    try:
        assert "registered already" in refusal(lambda: triton.register_system_shared_memory("r", key, 1024))
        tensor = kind.InferInput("input_tensor", [1, *RED_GREEN.shape], "UINT8")
        tensor.set_shared_memory("r", RED_GREEN[None].nbytes)  # 9216 bytes in a region of 1024
        assert "past the end" in refusal(lambda: triton.infer("blob", [tensor]))
        tensor = kind.InferInput("input_tensor", [1, 8, 8, 3], "UINT8")
        tensor.set_shared_memory("nope", 192)
        assert "not registered" in refusal(lambda: triton.infer("blob", [tensor]))
        carried = kind.InferInput("input_tensor", [1, *RED_GREEN.shape], "UINT8")
        carried.set_data_from_numpy(RED_GREEN[None])
        output = kind.InferRequestedOutput("detection_boxes")
        output.set_shared_memory("r", 16)  # too small for [1, K, 4] FP32 boxes
        assert "needs" in refusal(lambda: triton.infer("blob", [carried], outputs=[output]))
    finally:
        triton.unregister_system_shared_memory("r")
    triton.unregister_system_shared_memory("r")  # a name not registered: no error, as Triton answers it
    assert "is registered" in refusal(lambda: triton.get_system_shared_memory_status("r"))
    assert key.strip("/") not in mapped_keys(server)
    assert "Traceback" not in server.log()


def test_a_region_shrunk_after_registration_is_refused_and_the_server_stays_up(client, server, regions):
    """A mapped read past the object's end would end the server with SIGBUS; the server reads with pread instead."""
    kind, triton = client
    key, handle = regions(RED_GREEN[None].nbytes)
    shm.set_shared_memory_region(handle, [RED_GREEN[None]])
    triton.register_system_shared_memory("shrunk", key, RED_GREEN[None].nbytes)
    try:
        os.truncate("/dev/shm" + key, 16)
        tensor = kind.InferInput("input_tensor", [1, *RED_GREEN.shape], "UINT8")
        tensor.set_shared_memory("shrunk", RED_GREEN[None].nbytes)
        assert "made smaller" in refusal(lambda: triton.infer("blob", [tensor]))
        assert triton.is_server_live() and server.process.poll() is None
    finally:
        triton.unregister_system_shared_memory("shrunk")


def test_an_output_region_is_checked_before_the_model_runs(client, regions):
    kind, triton = client
    key, _ = regions(64)
    triton.register_system_shared_memory("small", key, 64)
    try:
        before = triton.get_inference_statistics("blob")
        carried = kind.InferInput("input_tensor", [1, *RED_GREEN.shape], "UINT8")
        carried.set_data_from_numpy(RED_GREEN[None])
        output = kind.InferRequestedOutput("detection_boxes")
        output.set_shared_memory("small", 128)  # past the region's 64 bytes
        assert "past the end" in refusal(lambda: triton.infer("blob", [carried], outputs=[output]))
        after = triton.get_inference_statistics("blob")
        count = (lambda stats: stats["model_stats"][0]["execution_count"]) if kind is triton_http else \
            (lambda stats: stats.model_stats[0].execution_count)
        assert count(after) == count(before)  # refused before any model call
    finally:
        triton.unregister_system_shared_memory("small")


def test_cuda_shared_memory_is_refused_as_not_implemented(server):
    status, _, body = server.request("POST", "/v2/cudasharedmemory/region/r/register", b"{}")
    assert status == 400 and "CUDA shared memory extension is not implemented" in body["error"]


def test_registration_is_a_control_route_kept_to_loopback(server):
    from app.access import SHARED_MEMORY, group_refusal

    assert group_refusal(SHARED_MEMORY, {}, "10.0.0.7", ()) is not None
    assert group_refusal(SHARED_MEMORY, {}, "127.0.0.1", ()) is None
