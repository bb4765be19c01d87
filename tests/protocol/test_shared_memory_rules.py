"""Triton's system shared memory, attacked as a client would: a client on another host naming a region another
client registered, an object another user owns, a region that costs its client nothing and the server everything,
outputs that do not fit, and names that do not travel. Real /dev/shm objects, a real second host (a network
namespace, tests/netns.py), real servers over HTTP and gRPC.

Before these rules, a client off the host read another client's region four bytes at a time through BYTES length
errors and wrote into it through outputs; the server registered any object it could open, whoever owned it; twelve
requests naming a sparse 256 MiB object grew the server by 2.4 GB; and an output that did not fit was found after
another output had been written.
"""

from __future__ import annotations

import json
import os
import textwrap
import threading
import uuid
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from blob_model import blob_image
from conftest import http_request, start_server
from netns import ForeignHost, HostUnavailable

SHM = Path("/dev/shm")
SECRET = b"TOPSECRET-registered-by-another-client" + bytes(range(64))
IMAGE = blob_image(32, 24, {1: (4, 4, 12, 12)})


@pytest.fixture
def objects():
    """Create /dev/shm objects for a test (their keys), and remove them afterwards."""
    made: list[Path] = []

    def make(data: bytes = b"", size: int | None = None, owner: int | None = None, mode: int = 0o600) -> str:
        path = SHM / f"detect-test-{uuid.uuid4().hex[:12]}"
        path.write_bytes(data)
        if size is not None:
            os.truncate(path, size)  # sparse: the pages are not there until read
        path.chmod(mode)
        if owner is not None:
            os.chown(path, owner, owner)
        made.append(path)
        return "/" + path.name

    yield make
    for path in made:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def open_server(blob_model_dir, tmp_path_factory):
    """A server listening on every address (so that a second host reaches it), gRPC too."""
    server = start_server({"DETECT_MODEL": str(blob_model_dir), "DETECT_HOST": "0.0.0.0", "DETECT_IDLE_UNLOAD_S": "0",
                           "DETECT_SPARE_WORKERS": "0", "DETECT_MAX_BODY_BYTES": "2MiB"},
                          tmp_path_factory.mktemp("shm") / "server.log")
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.log()


@pytest.fixture(scope="module")
def foreign():
    try:
        host = ForeignHost.make()
    except HostUnavailable as why:
        pytest.skip(f"no second host: {why}")
    yield host
    host.close()


def register(server, name: str, key: str, size: int, offset: int = 0) -> tuple[int, object]:
    status, _, body = http_request(server.port, "POST", f"/v2/systemsharedmemory/region/{name}/register",
                                   json.dumps({"key": key, "offset": offset, "byte_size": size}).encode())
    return status, body


def unregister(server, name: str) -> None:
    http_request(server.port, "POST", f"/v2/systemsharedmemory/region/{name}/unregister")


def infer_body(tensor: dict, outputs: list | None = None) -> bytes:
    return json.dumps({"inputs": [tensor], **({"outputs": outputs} if outputs else {})}).encode()


def placed_bytes_input(region: str, size: int, offset: int = 0) -> dict:
    return {"name": "image", "datatype": "BYTES", "shape": [1],
            "parameters": {"shared_memory_region": region, "shared_memory_byte_size": size,
                           "shared_memory_offset": offset}}


PIXELS = {"name": "input_tensor", "datatype": "UINT8", "shape": [1, *IMAGE.shape], "data": IMAGE.ravel().tolist()}

FOREIGN_CLIENT = textwrap.dedent("""
    import http.client, json, sys
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    host, port, grpc_port, region = sys.argv[1:] if len(sys.argv) > 1 else ({args})
    answers = {{}}
    def post(body):
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("POST", "/v2/models/blob/infer", body, {{"Content-Type": "application/json"}})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    for offset in (0, 4, 8):  # the leak read the region four bytes at a time
        tensor = {{"name": "image", "datatype": "BYTES", "shape": [1], "parameters": {{
            "shared_memory_region": region, "shared_memory_byte_size": 4, "shared_memory_offset": offset}}}}
        answers[f"http read {{offset}}"] = post(json.dumps({{"inputs": [tensor]}}).encode())
    pixels = {pixels}
    write = {{"name": "num_detections", "parameters": {{"shared_memory_region": region,
              "shared_memory_byte_size": 4, "shared_memory_offset": 6}}}}
    answers["http write"] = post(json.dumps({{"inputs": [pixels], "outputs": [write]}}).encode())
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/v2/systemsharedmemory/region/mine/register", json.dumps(
        {{"key": "/anything", "offset": 0, "byte_size": 4}}))
    response = conn.getresponse()
    answers["http register"] = (response.status, json.loads(response.read()))
    with grpc.insecure_channel(f"{{host}}:{{grpc_port}}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="blob")
        tensor = request.inputs.add(name="image", datatype="BYTES", shape=[1])
        tensor.parameters["shared_memory_region"].string_param = region
        tensor.parameters["shared_memory_byte_size"].int64_param = 4
        try:
            stub.ModelInfer(request, timeout=30)
            answers["grpc read"] = ("OK", "")
        except grpc.RpcError as error:
            answers["grpc read"] = (error.code().name, error.details())
    print(json.dumps(answers))
""")


def test_a_client_off_the_host_can_neither_read_nor_write_a_region_another_client_registered(open_server, foreign,
                                                                                            objects):
    key = objects(SECRET)
    assert register(open_server, "secret", key, len(SECRET))[0] == 200
    try:
        code = FOREIGN_CLIENT.format(args=repr((foreign.server_address, open_server.port, open_server.grpc_port,
                                                "secret")), pixels=json.dumps(PIXELS))
        done = foreign.python(code)
        assert done.returncode == 0, done.stderr[-2000:]
        answers = json.loads(done.stdout)
        for name in ("http read 0", "http read 4", "http read 8", "http write", "http register"):
            status, body = answers[name]
            assert status == 403 and "loopback clients only" in body["error"], (name, answers[name])
        assert answers["grpc read"][0] == "PERMISSION_DENIED" and "loopback" in answers["grpc read"][1]
        assert not any("length of" in json.dumps(answer) for answer in answers.values())  # nothing of it leaked
        assert (SHM / key.strip("/")).read_bytes() == SECRET  # nothing written
        # From this host the same request is let through to the region (its BYTES are no image, a 400 of its own).
        status, _, body = http_request(open_server.port, "POST", "/v2/models/blob/infer",
                                       infer_body(placed_bytes_input("secret", 4)))
        assert status == 400 and "length of" in body["error"]
    finally:
        unregister(open_server, "secret")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving an object to another user needs root")
def test_an_object_another_user_owns_is_not_registered_unless_the_operator_allows_it(open_server, objects,
                                                                                     blob_model_dir, tmp_path):
    nobody = 65534
    key = objects(SECRET, owner=nobody)  # 0600, nobody's: the server, as root, could open it
    status, body = register(open_server, "theirs", key, len(SECRET))
    assert status == 400 and f"belongs to user {nobody}" in body["error"] and "shared_memory_same_owner" in body["error"]
    with grpc.insecure_channel(f"127.0.0.1:{open_server.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.SystemSharedMemoryRegister(service_pb2.SystemSharedMemoryRegisterRequest(
                name="theirs", key=key, byte_size=len(SECRET)), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    allowing = start_server({"DETECT_MODEL": str(blob_model_dir), "DETECT_SHARED_MEMORY_SAME_OWNER": "false",
                             "DETECT_SPARE_WORKERS": "0"}, tmp_path / "allowing.log")
    try:
        assert register(allowing, "theirs", key, len(SECRET))[0] == 200
        unregister(allowing, "theirs")
    finally:
        allowing.stop()


def test_an_object_that_is_not_a_regular_file_is_refused_at_once(open_server):
    fifo = SHM / f"detect-test-fifo-{uuid.uuid4().hex[:8]}"
    os.mkfifo(fifo)
    try:
        status, body = register(open_server, "fifo", "/" + fifo.name, 4)
        assert status == 400 and "not a regular file" in body["error"]
    finally:
        fifo.unlink()
    status, body = register(open_server, "up", "/..", 4)
    assert status == 400 and "not a POSIX shared-memory name" in body["error"]


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_256_mib_region_is_refused_before_a_byte_is_read_under_12_concurrent_requests(open_server, objects):
    """Twelve requests at once name a sparse 256 MiB object as their input: each is refused (413 naming
    max_body_bytes, RESOURCE_EXHAUSTED over gRPC) before it is read, and the server's peak memory grows by far
    less than 512 MiB (it grew by 2.4 GB when each was read whole before being refused)."""
    size = 256 * 2**20
    key = objects(size=size)
    assert register(open_server, "huge", key, size)[0] == 200
    before = vm_hwm_mib(open_server.process.pid)
    answers: list = []

    def over_http():
        answers.append(http_request(open_server.port, "POST", "/v2/models/blob/infer",
                                    infer_body(placed_bytes_input("huge", size)))[:3:2])

    def over_grpc():
        with grpc.insecure_channel(f"127.0.0.1:{open_server.grpc_port}") as channel:
            request = service_pb2.ModelInferRequest(model_name="blob")
            tensor = request.inputs.add(name="image", datatype="BYTES", shape=[1])
            tensor.parameters["shared_memory_region"].string_param = "huge"
            tensor.parameters["shared_memory_byte_size"].int64_param = size
            try:
                service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
                answers.append(("OK", ""))
            except grpc.RpcError as error:
                answers.append((error.code().name, error.details()))

    try:
        threads = [threading.Thread(target=over_http if i % 2 else over_grpc) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        unregister(open_server, "huge")
    growth = vm_hwm_mib(open_server.process.pid) - before
    assert len(answers) == 12
    for status, body in answers:
        message = body["error"] if isinstance(body, dict) else body
        assert status in (413, "RESOURCE_EXHAUSTED") and "max_body_bytes" in message, (status, body)
    assert growth < 512, f"the server's peak RSS grew by {growth:.0f} MiB"


def test_an_output_that_does_not_fit_is_refused_before_the_model_runs_and_nothing_is_written(open_server, objects):
    """Two outputs into one region: detection_boxes fits, num_detections (its size fixed by the signature) does not.
    The request is refused naming num_detections, the model never ran it, and the region is as it was."""
    key = objects(b"\xab" * 4096)
    assert register(open_server, "out", key, 4096)[0] == 200
    stats = lambda: http_request(open_server.port, "GET", "/v2/models/blob/stats")[2]["model_stats"][0][  # noqa: E731
        "inference_stats"]["success"]["count"]
    ran_before = stats()
    try:
        outputs = [{"name": "detection_boxes", "parameters": {"shared_memory_region": "out",
                                                              "shared_memory_byte_size": 1024}},
                   {"name": "num_detections", "parameters": {"shared_memory_region": "out",
                                                             "shared_memory_byte_size": 2,
                                                             "shared_memory_offset": 2048}}]
        status, _, body = http_request(open_server.port, "POST", "/v2/models/blob/infer", infer_body(PIXELS, outputs))
        assert status == 400 and "'num_detections' needs 4 bytes" in body["error"]
        assert stats() == ran_before
        # detections (BYTES, its size known only once the model ran) too small: nothing written either.
        outputs = [{"name": "detection_boxes", "parameters": {"shared_memory_region": "out",
                                                              "shared_memory_byte_size": 1024}},
                   {"name": "detections", "parameters": {"shared_memory_region": "out",
                                                         "shared_memory_byte_size": 8, "shared_memory_offset": 2048}}]
        status, _, body = http_request(open_server.port, "POST", "/v2/models/blob/infer", infer_body(PIXELS, outputs))
        assert status == 400 and "'detections' needs" in body["error"]
        assert (SHM / key.strip("/")).read_bytes() == b"\xab" * 4096
    finally:
        unregister(open_server, "out")


@pytest.mark.parametrize("name", ["r\n", "a/b", "with space", "", "x" * 257, "tab\t"])
def test_a_name_outside_the_one_rule_is_refused_by_both_doors(open_server, objects, name):
    key = objects(b"\0" * 16)
    with grpc.insecure_channel(f"127.0.0.1:{open_server.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).SystemSharedMemoryRegister(
                service_pb2.SystemSharedMemoryRegisterRequest(name=name, key=key, byte_size=16), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "name must be" in refused.value.details()
    if name and "/" not in name:  # a name with a slash has no HTTP path to be sent on
        status, body = register(open_server, name.replace("\n", "%0A").replace(" ", "%20").replace("\t", "%09"),
                                key, 16)
        assert status == 400 and "name must be" in body["error"]


@pytest.mark.parametrize("key", ["/detect\n", "/../etc", "no/slash/inside", "/" + "k" * 251])
def test_a_key_outside_the_posix_rule_is_refused(open_server, key):
    status, body = register(open_server, "k", key, 16)
    assert status == 400 and "not a POSIX shared-memory name" in body["error"]


def test_a_name_registered_over_grpc_is_read_and_unregistered_over_http(open_server, objects):
    key = objects(b"\0" * 16)
    name = "in-1.x:y@z+"
    with grpc.insecure_channel(f"127.0.0.1:{open_server.grpc_port}") as channel:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).SystemSharedMemoryRegister(
            service_pb2.SystemSharedMemoryRegisterRequest(name=name, key=key, byte_size=16), timeout=10)
    status, _, body = http_request(open_server.port, "GET", f"/v2/systemsharedmemory/region/{name}/status")
    assert status == 200 and body == [{"name": name, "key": key, "offset": 0, "byte_size": 16}]
    assert http_request(open_server.port, "POST", f"/v2/systemsharedmemory/region/{name}/unregister")[0] == 200
    assert http_request(open_server.port, "GET", "/v2/systemsharedmemory/status")[2] == []


def test_a_shared_memory_input_is_checked_against_its_declared_shape_before_it_is_read(open_server, objects):
    key = objects(IMAGE.tobytes())
    assert register(open_server, "px", key, IMAGE.nbytes)[0] == 200
    try:
        tensor = {"name": "input_tensor", "datatype": "UINT8", "shape": [1, *IMAGE.shape],
                  "parameters": {"shared_memory_region": "px", "shared_memory_byte_size": IMAGE.nbytes - 1}}
        status, _, body = http_request(open_server.port, "POST", "/v2/models/blob/infer", infer_body(tensor))
        assert status == 400 and f"shared_memory_byte_size is {IMAGE.nbytes - 1}" in body["error"]
        tensor["parameters"]["shared_memory_byte_size"] = IMAGE.nbytes
        status, _, body = http_request(open_server.port, "POST", "/v2/models/blob/infer", infer_body(tensor))
        assert status == 200 and {o["name"] for o in body["outputs"]} >= {"num_detections"}
    finally:
        unregister(open_server, "px")
