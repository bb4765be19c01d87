"""`grpc.health.v1.Health`: the server's readiness and each model's, for Kubernetes' `grpc:` probes and grpc-health-probe.

The name "liveness" is SERVING while the server answers at all, as /healthz would (a Kubernetes liveness probe's
service): while the Twisted reactor, which every HTTP request passes, still beats (app/hosting/lifecycle.py).
A stuck reactor turns it NOT_SERVING within STALE_AFTER_S, so the probe fails and the pod is restarted, though
the gRPC threads still answer. The service "" (the whole server) and the name of each gRPC service on the port are SERVING while /readyz
would answer 200: every preloaded model loaded, shutdown not begun. A model's name is SERVING while it can
answer: loaded, or unloaded only for idleness (its next call loads it); NOT_SERVING while it loads, has
failed or was unloaded by request. Any other name is NOT_FOUND, as the health protocol asks.
"""

from __future__ import annotations

import time

from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..errors import NotFound
from ..protocol.plane import DataPlane

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WATCH_POLL_S = 1.0
LIVENESS = "liveness"  # SERVING while the reactor beats, as /healthz would answer


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Answer Check and Watch from the live state of the server and its models; called in gRPC worker threads."""

    def __init__(self, plane: DataPlane, service_names: tuple[str, ...]):
        self._plane = plane
        self._names = ("", *service_names)

    def status(self, name: str):
        """The status of `name` (the server, a gRPC service, or a model); None for a name that is none of those."""
        if name == LIVENESS:
            return SERVING if self._plane.alive() else NOT_SERVING
        if name in self._names:
            return SERVING if self._plane.ready() else NOT_SERVING
        model = self._plane.find_model(name)
        if model is None:
            return None
        if model.state == "ready" or (model.state == "unloaded" and not model.unloaded_by_request):
            return SERVING
        return NOT_SERVING

    def Check(self, request, context):
        status = self.status(request.service)
        if status is None:
            raise NotFound(f"no service or model named {request.service[:100]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request, context):
        """Send the status now and on every change (checked each second), until the client goes away."""
        last = None
        while context.is_active():
            status = self.status(request.service)
            status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if status is None else status
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            time.sleep(WATCH_POLL_S)
