"""gRPC health's "liveness" tells the truth about the process: SERVING while the Twisted reactor, which every HTTP
request passes, beats; NOT_SERVING once it has stopped answering, though the gRPC threads still answer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ROOT

# A real reactor beating as app/hosting/serve.py has it beat, and the real health servicer on a real gRPC port;
# after 2 s a callable on the reactor blocks it for 9 s, as a stuck handler would.
STALLING_SERVER = textwrap.dedent("""
    import sys, time
    from concurrent.futures import ThreadPoolExecutor
    import grpc
    from grpc_health.v1 import health_pb2_grpc
    from twisted.internet import reactor, task
    from app.grpc.health import HealthServicer
    from app.hosting.lifecycle import HEARTBEAT_S, Lifecycle
    from app.metrics import ServiceMetrics
    from app.protocol.plane import DataPlane
    from app.settings import Settings

    lifecycle = Lifecycle()
    plane = DataPlane(Settings(), models=None, gpu=None, metrics=ServiceMetrics(), lifecycle=lifecycle)
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(plane, ()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    reactor.callWhenRunning(task.LoopingCall(lifecycle.beat).start, HEARTBEAT_S)
    reactor.callLater(2.0, time.sleep, 9.0)
    reactor.callLater(14.0, reactor.stop)
    reactor.run()
""")


def liveness(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="liveness"),
                                                           timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def test_liveness_fails_while_the_reactor_is_stuck_and_recovers_after(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", STALLING_SERVER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline())
        started = time.monotonic()
        assert liveness(port) == "SERVING"
        time.sleep(max(0.0, started + 8.5 - time.monotonic()))  # the reactor stalled at 2 s: 6.5 s ago, over 5 s
        assert liveness(port) == "NOT_SERVING"
        time.sleep(max(0.0, started + 12.5 - time.monotonic()))  # it turns again from 11 s on
        assert liveness(port) == "SERVING"
    finally:
        process.kill()
        process.wait(timeout=10)
        process.stdout.close()


def test_a_running_servers_reactor_beats_so_its_liveness_holds_past_the_stale_limit(server):
    """The real server wires the heartbeat: more than STALE_AFTER_S after its start its liveness is still SERVING
    (without the beat, the one at start would be stale by then)."""
    from app.hosting.lifecycle import STALE_AFTER_S

    time.sleep(STALE_AFTER_S + 1)
    assert liveness(server.grpc_port) == "SERVING"
