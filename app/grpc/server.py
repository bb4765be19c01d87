"""The gRPC port: one grpc.server beside the HTTP site, in the same process, over the same data plane.

Services: KServe v2's inference.GRPCInferenceService (kserve.py), TF Serving's PredictionService and
ModelService (tfserving.py), grpc.health.v1.Health (health.py) and server reflection, so that grpcurl needs
no .proto files. Every call passes CallInterceptor (calls.py): the access rules, the status table, metrics.

Bounds, as the HTTP site's, from the one admission rule (app/protocol/admission.py): at most http_threads
inference calls at once, none while their model's queue is full, and each kind of call a client holds open
(ModelStreamInfer, health Watch, reflection) within its own cap and ended once idle; the one over a cap is
answered RESOURCE_EXHAUSTED at once. Each kind runs on a thread pool of its own and the probes on theirs
(app/grpc/calls.py), so no caller can take the threads a liveness or readiness probe needs. gRPC's own
limit on concurrent calls is not set: it counts probes with everything else, and one over it would refuse
the probe. A message over max_body_bytes is answered RESOURCE_EXHAUSTED by grpc before it is read whole.
"""

from __future__ import annotations

import logging
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..protocol.admission import HELD, Admission
from ..protocol.plane import DataPlane
from .calls import CallInterceptor, Pools, answer_unimplemented
from .health import HealthServicer
from .kserve import InferenceServicer
from .protos import grpc_service_pb2
from .protos import grpc_service_pb2_grpc as kserve_grpc
from .protos.tensorflow_serving.apis import model_service_pb2, prediction_service_pb2
from .protos.tensorflow_serving.apis import model_service_pb2_grpc, prediction_service_pb2_grpc
from .streams import Streams
from .tfserving import ModelServicer, PredictionServicer

log = logging.getLogger(__name__)

SERVICE_NAMES = tuple(d.full_name for d in (
    grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
    prediction_service_pb2.DESCRIPTOR.services_by_name["PredictionService"],
    model_service_pb2.DESCRIPTOR.services_by_name["ModelService"],
))


class GrpcServer:
    """The gRPC services over one data plane, on one port; built at boot, bound and started by the composition root."""

    def __init__(self, plane: DataPlane):
        settings = plane.settings
        metrics = plane.metrics
        self.admission = Admission("grpc", settings, plane.lifecycle,
                                   on_idle_end=lambda kind: metrics.observe_idle_end("grpc", kind))
        self._streams = Streams(settings.http_threads)
        self._pools = Pools(settings, self.admission.caps)
        metrics.watch_grpc_in_flight(lambda: self.admission.open_calls("inference"))
        metrics.watch_open_calls(self.admission, HELD)
        self._server = grpc.server(
            self._pools.main, interceptors=[CallInterceptor(plane, self.admission, self._pools)],
            options=[
                ("grpc.max_receive_message_length", settings.max_body_bytes),
                # Off: with SO_REUSEPORT (grpc's default on Linux) a second server would share a busy port silently.
                ("grpc.so_reuseport", 0),
            ])
        kserve, prediction, model_service = SERVICE_NAMES
        kserve_grpc.add_GRPCInferenceServiceServicer_to_server(answer_unimplemented(
            InferenceServicer(plane, self.admission, self._streams), kserve_grpc.GRPCInferenceServiceServicer, kserve), self._server)
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(answer_unimplemented(
            PredictionServicer(plane, self.admission), prediction_service_pb2_grpc.PredictionServiceServicer,
            prediction), self._server)
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(answer_unimplemented(
            ModelServicer(plane), model_service_pb2_grpc.ModelServiceServicer, model_service), self._server)
        self._health = HealthServicer(plane, SERVICE_NAMES)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection((*SERVICE_NAMES, health_name, reflection.SERVICE_NAME), self._server)

    def bind(self, host: str, port: int, tls: Optional[tuple[bytes, bytes]] = None) -> int:
        """Listen on host:port (TLS with a (key, certificate) PEM pair); return the port bound; raise RuntimeError."""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if tls is None:
            bound = self._server.add_insecure_port(address)
        else:
            bound = self._server.add_secure_port(address, grpc.ssl_server_credentials([tls]))
        if not bound:  # older grpcio answers 0 rather than raising
            raise RuntimeError(f"cannot bind {address}")
        return bound

    def start(self) -> None:
        self._server.start()

    def drain(self, grace_s: float) -> None:
        """Stop taking calls and wait for those in flight, at most `grace_s`, then cancel them; blocks. The Watch
        calls end at once (they would hold the grace to its end)."""
        self._health.watches.end_all()
        self._server.stop(grace_s).wait()

    def stop(self) -> None:
        self._health.watches.end_all()
        self._server.stop(0)
        self._streams.stop()
        self._pools.shutdown()
        self.admission.stop()
