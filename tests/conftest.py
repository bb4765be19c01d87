"""Shared fixtures: small real SavedModels built by the tests, the Flask app, and a real server."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.process import configure_pillow
from blob_model import build_blob_model

ROOT = Path(__file__).resolve().parent.parent

configure_pillow()  # the test process decodes uploads as the HTTP process does


@pytest.fixture(scope="session")
def blob_model_dir(tmp_path_factory) -> Path:
    """A base path `blob/` holding versions 1 and 2 (batch None); 2 is the one served."""
    base = tmp_path_factory.mktemp("models") / "blob"
    build_blob_model(base / "1")
    build_blob_model(base / "2")
    return base


@pytest.fixture(scope="session")
def blob_batch1_dir(tmp_path_factory) -> Path:
    """A version folder of the blob detector with its batch fixed at 1, as model-zoo exports have."""
    return build_blob_model(tmp_path_factory.mktemp("models") / "blob1" / "7", batch=1)


@pytest.fixture(scope="session")
def slow_blob_model_dir(tmp_path_factory) -> Path:
    """A version folder of the blob detector that takes a second or more per call, even on a tiny image."""
    return build_blob_model(tmp_path_factory.mktemp("models") / "slowblob" / "1", busy_products=600)


@pytest.fixture(scope="session")
def detector(blob_model_dir):
    """The blob detector loaded in this test process (TensorFlow in-process, as a worker has it)."""
    from app.inference.detector import load_detector

    return load_detector(blob_model_dir)


@contextmanager
def running_registry(model: Path | str = "", repository: Path | str = "", timeout: float = 120.0, wait: bool = True,
                     **overrides):
    """A real model registry in this test process, its workers real processes; ready when yielded (if `wait`)."""
    from app.metrics import ServiceMetrics
    from app.models.registry import ModelRegistry
    from app.models.repository import ModelRepository
    from app.settings import Settings

    overrides.setdefault("precision", "fp32")  # the same on every CI machine, as start_server's servers
    settings = Settings(model=str(model), model_repository=str(repository or ROOT / "models"), **overrides)
    registry = ModelRegistry(settings, ModelRepository.open(settings.model_repository, settings.model), gpus=None,
                             metrics=ServiceMetrics())
    registry.start()
    try:
        deadline = time.monotonic() + timeout
        while wait and not registry.ready:
            assert registry.boot_failure() is None, registry.boot_failure()
            assert time.monotonic() < deadline, "the registry did not become ready"
            time.sleep(0.05)
        yield registry
    finally:
        registry.close(10.0)


@pytest.fixture(scope="session")
def blob_registry(blob_model_dir):
    """The blob model served by a real registry and worker, shared by the Flask-level tests."""
    with running_registry(blob_model_dir, spare_workers=0, idle_unload_s=0) as registry:  # loaded all session
        yield registry


@pytest.fixture
def app_factory(blob_registry):
    """Build a Flask app around real collaborators; keyword arguments override settings."""
    from app.gpu.report import GpuReport
    from app.hosting.lifecycle import Lifecycle
    from app.http.app import create_app
    from app.protocol.plane import DataPlane
    from app.settings import Settings

    def make(models=None, lifecycle=None, **overrides):
        models = models if models is not None else blob_registry
        settings = Settings(model=str(models.settings.model), **overrides)
        gpu = GpuReport(None, "no NVML in this test", workers=models.workers)
        return create_app(DataPlane(settings, models, gpu, models.metrics, lifecycle or Lifecycle()))

    return make


@pytest.fixture
def client(app_factory):
    return app_factory().test_client()


def http_request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                 timeout: float = 60.0):
    """Send one request to 127.0.0.1:`port`; return (status, headers, parsed JSON or raw bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    kind = response.getheader("Content-Type", "")
    return response.status, dict(response.getheaders()), json.loads(data) if "json" in kind else data


def gauge(server, series: str) -> int:
    """Read one gauge series (name and labels) from the /metrics of `server` (anything with `request`)."""
    text = server.request("GET", "/metrics")[2].decode()
    return int(float(re.search(rf"^{re.escape(series)} (\S+)$", text, re.M).group(1)))


def in_flight(server) -> int:
    """HTTP requests in flight at `server`, less the /metrics request that asks."""
    return gauge(server, "detect_http_requests_in_flight") - 1


@dataclass
class Server:
    """A real `python -m app serve` subprocess on a free port."""

    process: subprocess.Popen
    port: int
    log_path: Path
    grpc_port: int | None = None  # None where DETECT_GRPC_PORT is off

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = 60.0):
        """Send one request; return (status, headers, parsed JSON or raw bytes)."""
        return http_request(self.port, method, path, body, headers, timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def wait_for(predicate, timeout: float, what: str, log_path: Path | None = None):
    """Return predicate()'s first true value, polled for up to `timeout` s; fail naming `what` (and the log's end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    tail = f":\n{log_path.read_text(errors='replace')[-5000:]}" if log_path is not None else ""
    raise AssertionError(f"timed out waiting for {what}{tail}")


_STARTED: list[subprocess.Popen] = []  # every server the tests started, for the end-of-session sweep


@pytest.fixture(scope="session", autouse=True)
def no_server_outlives_the_session():
    """Kill any server a failed test left running (its workers follow when their channel closes)."""
    yield
    for process in _STARTED:
        if process.poll() is None:
            process.kill()
            process.wait()


def start_server(env: dict, log_path: Path, args: list[str] = (), ready: bool = True,
                 timeout: float = 180.0) -> Server:
    """Start the service with DETECT_* settings from `env` on port 0 (gRPC too); wait until it listens (and is ready).

    A None in `env` leaves that variable unset (the setting's default). The server says "listening" and
    "ready" on its notify descriptor, as it does to the fleet.
    """
    from app.hosting.lifecycle import Notifications

    notifications = Notifications()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    # fp32 unless a test asks otherwise: answers and what /models says are then the same on every CI machine,
    # with native bf16 or without; tests/test_precision.py runs the others.
    full_env.update({"DETECT_PORT": "0", "DETECT_GRPC_PORT": "0", "DETECT_LOG_LEVEL": "INFO", "TF_CPP_MIN_LOG_LEVEL": "2",
                     "DETECT_PRECISION": "fp32", "DETECT_NOTIFY_FD": str(notifications.child_fd), **env})
    full_env = {key: value for key, value in full_env.items() if value is not None}
    with log_path.open("wb") as handle:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", *args], cwd=ROOT, env=full_env,
            stdout=handle, stderr=subprocess.STDOUT, pass_fds=[notifications.child_fd],
        )
    _STARTED.append(process)
    notifications.started()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            listening = notifications.find("listening")
            if listening is not None and (not ready or notifications.find("ready") is not None):
                return Server(process, listening["port"], log_path, listening.get("grpc_port"))
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.05)
    finally:
        notifications.close()
    process.kill()
    raise RuntimeError(f"server did not start in {timeout} s:\n{log_path.read_text(errors='replace')}")


@pytest.fixture(scope="session")
def server(blob_model_dir, tmp_path_factory):
    """One real server on the blob model, shared by the HTTP tests."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server(
        {"DETECT_MODEL": str(blob_model_dir), "DETECT_MAX_BODY_BYTES": "2MiB",
         "DETECT_MAX_IMAGE_PIXELS": "4000000", "DETECT_MAX_IMAGES_PER_REQUEST": "4",
         "DETECT_HEADER_TIMEOUT_S": "1", "DETECT_BODY_TIMEOUT_S": "2",
         # The session is longer than the idle unload's 300 s; the tests on this server expect it loaded.
         "DETECT_IDLE_UNLOAD_S": "0"},
        log_path,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def perf_analyzer() -> list[str]:
    """The argv prefix that starts Triton's perf_analyzer 2.60 (set up on first use); skip saying why if it cannot be."""
    from tools import clients

    try:
        return clients.perf_analyzer_command()
    except clients.ClientUnavailable as error:
        pytest.skip(f"perf_analyzer is not available here: {error}")


@pytest.fixture(scope="session")
def kserve_python() -> Path:
    """The python of a venv holding KServe's SDK 0.21 (made on first use); skip saying why if it cannot be."""
    from tools import clients

    try:
        return clients.kserve_python()
    except clients.ClientUnavailable as error:
        pytest.skip(f"KServe's SDK is not available here: {error}")


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests where no NVIDIA driver is present."""
    if os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version"):
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
