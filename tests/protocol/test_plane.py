"""The data plane itself (app/protocol/plane.py), in-process: the one readiness rule, the shared-memory right checked
for the client of the request in hand, and a request's images never reaching the model once its client has gone.
The doors are driven through real servers elsewhere (tests/protocol/test_*.py, tests/test_protocols.py); here the
plane is given stand-ins for the registry and a model, so each rule is seen alone."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np
import pytest

from app.errors import ClientGone, Forbidden, InvalidBody, NotReady
from app.inference.images import DecodedImage
from app.metrics import ServiceMetrics
from app.protocol import context
from app.protocol.context import Client
from app.protocol.plane import DataPlane
from app.settings import Settings


@dataclass
class Registry:
    ready: bool = True
    failure: str | None = None

    def boot_failure(self):
        return self.failure


@dataclass
class Lifecycle:
    draining: bool = False
    responsive: bool = True


@dataclass
class Model:
    """What run_images uses of a served model; records what reached it."""

    name: str = "m"
    ran: list = field(default_factory=list)
    in_flight: int = 0

    def admit(self):
        self.in_flight += 1

    def release(self):
        self.in_flight -= 1

    def wait_ready(self, deadline):
        return 0.0

    def detect_outputs(self, images, deadline, timeline=None, cancellation=None):
        if cancellation is not None and cancellation.cancelled:
            raise ClientGone("gone")
        self.ran.extend(images)
        return [SimpleNamespace(version="1") for _ in images]


def plane_with(settings: Settings = Settings(), registry: Registry | None = None,
               lifecycle: Lifecycle | None = None) -> DataPlane:
    return DataPlane(settings, registry or Registry(), gpu=None, metrics=ServiceMetrics(), lifecycle=lifecycle)


@pytest.mark.parametrize("registry, lifecycle, reason", [
    (Registry(), Lifecycle(), None),
    (Registry(ready=False), Lifecycle(), "the models are loading"),
    (Registry(ready=False, failure="model m: bad"), Lifecycle(), "a preloaded model failed: model m: bad"),
    (Registry(), Lifecycle(draining=True), "the server is shutting down"),
])
def test_readiness_is_one_rule_every_health_answer_reads(registry, lifecycle, reason):
    plane = plane_with(registry=registry, lifecycle=lifecycle)
    refusal = plane.not_ready()
    assert (refusal.message if refusal else None) == reason
    assert plane.ready() is (reason is None)
    if refusal is not None:
        assert isinstance(refusal, NotReady)


@pytest.mark.parametrize("client, restricted, allowed", [
    (Client("127.0.0.1"), "", True),
    (Client("::1"), "", True),
    (Client("::ffff:127.0.0.1"), "", True),
    (Client("10.0.0.7"), "", False),
    (Client(None), "", False),  # no address at all is not loopback
    (Client("10.0.0.7", {"shm-key": "s3cret"}), "shared-memory:shm-key=s3cret", True),
    (Client("127.0.0.1"), "shared-memory:shm-key=s3cret", False),  # once restricted, loopback must send it too
    (Client("10.0.0.7", {"shm-key": "wrong"}), "shared-memory:shm-key=s3cret", False),
])
def test_naming_a_region_is_the_shared_memory_right_of_the_request_in_hand(client, restricted, allowed):
    plane = plane_with(replace(Settings(), restricted_api=restricted))
    token = context.begin(client=client)
    try:
        if allowed:  # let through to the regions, which say the name is not registered
            with pytest.raises(InvalidBody, match="not registered"):
                with plane.shared_memory_region("r", "input 'image'"):
                    pass
        else:
            with pytest.raises(Forbidden, match="shared"):
                plane.shared_memory_region("r", "input 'image'")
    finally:
        context.end(token)


def test_outside_a_request_no_client_may_name_a_region():
    with pytest.raises(Forbidden):
        plane_with().shared_memory_region("r", "input 'image'")


def image() -> DecodedImage:
    return DecodedImage(pixels=np.zeros((2, 2, 3), np.uint8), format="tensor", width=2, height=2)


def test_a_request_whose_client_went_while_it_decoded_never_reaches_the_model():
    plane, model = plane_with(), Model()
    token = context.begin()
    try:
        request = context.current()

        def prepare():
            request.cancellation.cancel()  # the connection closes while the images decode
            return [image()]

        with pytest.raises(ClientGone):
            plane.run_images(model, prepare, deadline=1e12)
    finally:
        context.end(token)
    assert model.ran == [] and model.in_flight == 0


def test_a_request_whose_client_stays_runs_and_lets_its_model_go():
    plane, model = plane_with(), Model()
    token = context.begin()
    try:
        run = plane.run_images(model, lambda: [image(), image()], deadline=1e12)
    finally:
        context.end(token)
    assert len(model.ran) == 2 and len(run.outputs) == 2 and model.in_flight == 0


def test_each_thread_has_its_own_request_context():
    seen = {}

    def request(name: str, address: str):
        token = context.begin(client=Client(address))
        try:
            context.name_model(name)
            seen[name] = (context.model_name(), context.current().client.address)
        finally:
            context.end(token)

    threads = [threading.Thread(target=request, args=(f"m{i}", f"10.0.0.{i}")) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {f"m{i}": (f"m{i}", f"10.0.0.{i}") for i in range(8)}
    assert context.current() is None
