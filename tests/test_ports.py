"""Several instances on one host with nothing but the HTTP port changed, the service's own case: the gRPC
port is off unless asked for, so a second and a third instance start beside the first; a port already held
stops the server with a line naming the setting, flag and variable that change it (docs/concepts/ports.md)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, start_server
from images_for_tests import encode
from test_http import RED_GREEN

from app.settings import Settings, load_settings


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_grpc_port_is_off_by_default_in_the_code_and_in_config_default_toml():
    assert Settings().grpc_port is None
    assert load_settings(config_path=ROOT / "config" / "default.toml", environ={}).grpc_port is None
    assert load_settings(environ={"DETECT_GRPC_PORT": "8001"}).grpc_port == 8001  # on when asked for


def test_three_instances_side_by_side_differ_only_in_their_http_port(blob_model_dir, tmp_path):
    """The second starts while the first serves, the third while both do; all answer /healthz and /detect."""
    same = {"DETECT_MODEL": str(blob_model_dir), "DETECT_SPARE_WORKERS": "0", "DETECT_GRPC_PORT": None}
    servers = []
    try:
        for index in range(3):
            servers.append(start_server({**same, "DETECT_PORT": str(free_port())}, tmp_path / f"server{index}.log"))
            assert servers[-1].grpc_port is None  # no second port to collide on
            for server in servers:  # two side by side, then three
                assert server.process.poll() is None, server.log()
                assert server.request("GET", "/healthz")[0] == 200
                status, _, answer = server.request("POST", "/detect", encode(RED_GREEN), {"Content-Type": "image/png"})
                assert status == 200 and answer["detections"], answer
        assert len({server.port for server in servers}) == 3
    finally:
        for server in servers:
            assert server.stop() == 0, server.log()


def held_port() -> socket.socket:
    """A port that another process's listening socket holds."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


@pytest.mark.parametrize("variable, names", [
    ("DETECT_PORT", "cannot listen for HTTP on 127.0.0.1:{port}: {reason}; is another server on it? change the "
                    "port with --port / DETECT_PORT / port in the config file"),
    ("DETECT_GRPC_PORT", "cannot listen for gRPC on 127.0.0.1:{port}: {reason}; is another server on it? change "
                         "the port with --grpc-port / DETECT_GRPC_PORT / grpc_port in the config file"),
])
def test_a_port_in_use_stops_the_server_with_a_line_naming_what_changes_it(variable, names, blob_model_dir):
    with held_port() as holder:
        port = holder.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
        env.update({"DETECT_PORT": str(free_port()), "DETECT_MODEL": str(blob_model_dir), "DETECT_SPARE_WORKERS": "0",
                    "TF_CPP_MIN_LOG_LEVEL": "2", variable: str(port)})
        result = subprocess.run([sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    before, _, after = names.format(port=port, reason="\0").partition("\0")
    assert line.startswith("error: " + before) and line.endswith(after), line
    assert "Traceback" not in result.stderr
