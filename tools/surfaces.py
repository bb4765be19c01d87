"""The protocol surfaces attacked as a client would, as figures: what each attack costs the server, and what the
probes answer meanwhile (issue 42; docs/measured.md#the-protocol-surfaces-under-attack).

    python -m tools.surfaces [--out out/surfaces] [--model models/shapes]

Starts the server of this checkout on one model, gRPC on, and makes four attacks in turn:

- 140 idle health Watch streams (the number that once filled gRPC's concurrent-call limit of http_threads + 4):
  how many opened, then the liveness probe, ServerLive and one ModelInfer, each with its answer and time;
- 140 idle reflection streams, each after one request: how many were let in, then the same three calls;
- a sparse 256 MiB /dev/shm object, registered, named as the input of 12 concurrent requests: their statuses
  and the server's peak resident memory growth (VmHWM);
- a v2 request whose `timeout` is 10**310: its status.

Prints a table and writes surfaces.json. Run it on another commit (a git worktree with this file copied in) to
compare: the tests in tests/protocol/ assert the behaviour; this tool measures it.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import uuid
from pathlib import Path

from tools import ROOT
from tools.chaos.traffic import http_exchange
from tools.server import ServerProcess, default_model, write_settings

HELD = 140
SHM_BYTES = 256 * 2**20
CONCURRENT = 12
SETTLE_S = 3.0


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def probes(grpc_port: int, model: str, image: bytes) -> dict:
    """The liveness probe, ServerLive and one ModelInfer: what each answered, and in how many ms."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from app.grpc.protos import grpc_service_pb2 as pb
    from app.grpc.protos import grpc_service_pb2_grpc as pb_grpc

    answers = {}
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        kserve = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name=model, inputs=[
            pb.ModelInferRequest.InferInputTensor(name="image", datatype="BYTES", shape=[1])],
            raw_input_contents=[len(image).to_bytes(4, "little") + image])
        for name, call in (
            ("liveness", lambda: health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=3)),
            ("ServerLive", lambda: kserve.ServerLive(pb.ServerLiveRequest(), timeout=3)),
            ("ModelInfer", lambda: kserve.ModelInfer(request, timeout=10)),
        ):
            started = time.monotonic()
            try:
                call()
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
            answers[name] = {"code": code, "ms": round((time.monotonic() - started) * 1000, 1)}
    return answers


def idle_watches(grpc_port: int, model: str, image: bytes) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channels = [grpc.insecure_channel(f"127.0.0.1:{grpc_port}") for _ in range(4)]
    try:
        calls = [health_pb2_grpc.HealthStub(channels[i % 4]).Watch(health_pb2.HealthCheckRequest())
                 for i in range(HELD)]
        opened = 0
        for call in calls:
            try:
                next(call)
                opened += 1
            except grpc.RpcError:
                pass
        return {"held": HELD, "opened": opened, "meanwhile": probes(grpc_port, model, image)}
    finally:
        for channel in channels:
            channel.close()


def idle_reflection(grpc_port: int, model: str, image: bytes) -> dict:
    import queue

    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    feeds = [queue.SimpleQueue() for _ in range(HELD)]
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        calls = [stub.ServerReflectionInfo(iter(feed.get, None)) for feed in feeds]
        for feed in feeds:
            feed.put(reflection_pb2.ServerReflectionRequest(list_services=""))
        codes: dict = {}
        for call in calls:
            try:
                next(call)
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
            codes[code] = codes.get(code, 0) + 1
        return {"held": HELD, "answers": codes, "meanwhile": probes(grpc_port, model, image)}
    finally:
        for feed in feeds:
            feed.put(None)
        channel.close()


def huge_region(server: ServerProcess, model: str) -> dict:
    path = Path("/dev/shm") / f"surfaces-{uuid.uuid4().hex[:8]}"
    path.write_bytes(b"")
    os.truncate(path, SHM_BYTES)  # sparse: it costs its client nothing
    try:
        status, _, _ = http_exchange(server.port, "POST", "/v2/systemsharedmemory/region/huge/register",
                                     json.dumps({"key": "/" + path.name, "byte_size": SHM_BYTES}).encode())
        if status != 200:
            return {"registered": status}
        body = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "parameters": {
            "shared_memory_region": "huge", "shared_memory_byte_size": SHM_BYTES}}]}).encode()
        before = peak_rss_mib(server.process.pid)
        statuses: list[int] = []

        def one() -> None:
            statuses.append(http_exchange(server.port, "POST", f"/v2/models/{model}/infer", body,
                                          timeout_s=300)[0])

        started = time.monotonic()
        threads = [threading.Thread(target=one) for _ in range(CONCURRENT)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return {"requests": CONCURRENT, "statuses": sorted(statuses), "s": round(time.monotonic() - started, 2),
                "peak_rss_growth_mib": round(peak_rss_mib(server.process.pid) - before, 1)}
    finally:
        http_exchange(server.port, "POST", "/v2/systemsharedmemory/unregister")
        path.unlink()


def huge_timeout(server: ServerProcess, model: str, image: bytes) -> dict:
    import base64

    body = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                   "data": [base64.b64encode(image).decode()]}],
                       "parameters": {"timeout": 10**310}}).encode()
    status, _, answer = http_exchange(server.port, "POST", f"/v2/models/{model}/infer", body)
    return {"status": status, "error": json.loads(answer).get("error", "")[:100]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.surfaces", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "surfaces")
    parser.add_argument("--model", type=Path, default=default_model())
    args = parser.parse_args(argv)
    out = args.out.resolve()
    config = out / "server.toml"
    write_settings(config, {"model": str(args.model.resolve()), "spare_workers": 0, "idle_unload_s": 0.0})
    image = (ROOT / "samples" / "scene.jpg").read_bytes()
    model = args.model.name
    server = ServerProcess.start(config, out / "server.log")
    attacks = {
        "idle watches": lambda: idle_watches(server.grpc_port, model, image),
        "idle reflection": lambda: idle_reflection(server.grpc_port, model, image),
        "a 256 MiB region, 12 requests": lambda: huge_region(server, model),
        "timeout 10**310": lambda: huge_timeout(server, model, image),
    }
    result = {"commit": os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip()}
    try:
        for name, attack in attacks.items():
            result[name] = attack()
            time.sleep(SETTLE_S)  # the calls an attack held end before the next begins
    finally:
        server.stop()
    (out / "surfaces.json").write_text(json.dumps(result, indent=1))
    for name, figures in result.items():
        print(f"{name:32s} {json.dumps(figures)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
