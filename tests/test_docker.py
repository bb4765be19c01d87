"""The container, without a Docker engine: hadolint on the Dockerfile, and its entry command run as the image would."""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from app.gpu.memory_policy import parse_memory_spec
from app.settings import Settings

DOCKERFILE = ROOT / "Dockerfile"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """Return the Dockerfile's (INSTRUCTION, arguments), continuation lines joined and comments dropped."""
    result, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, arguments = current.partition(" ")
        result.append((keyword.upper(), arguments.strip()))
        current = ""
    return result


def image_env() -> dict[str, str]:
    env = {}
    for keyword, arguments in instructions():
        if keyword == "ENV":
            env.update(token.split("=", 1) for token in shlex.split(arguments))
    return env


def exec_form(keyword: str) -> list[str]:
    (arguments,) = [a for k, a in instructions() if k == keyword]
    if keyword == "HEALTHCHECK":
        arguments = arguments.split(" CMD ", 1)[1]
    return json.loads(arguments)


def as_here(argv: list[str]) -> list[str]:
    """The image's python3 is this test's interpreter."""
    return [sys.executable if argv[0] in ("python", "python3") else argv[0], *argv[1:]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.fail("hadolint is not installed: it comes with the test extra (pip install -e '.[test]')")
    return found


def test_hadolint_finds_nothing_in_the_dockerfile():
    result = subprocess.run([_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_the_image_is_the_pinned_tensorflow_gpu_one_run_as_a_user_stopped_by_sigterm():
    pinned = re.search(r'"tensorflow>=([\d.]+),', (ROOT / "pyproject.toml").read_text()).group(1)
    keywords = dict(instructions())
    assert keywords["FROM"] == f"tensorflow/tensorflow:{pinned}.0-gpu"
    assert keywords["USER"].split(":")[0] not in ("root", "0")
    assert keywords["STOPSIGNAL"] == "SIGTERM"
    assert "/healthz" in " ".join(exec_form("HEALTHCHECK"))
    env = image_env()
    assert env["DETECT_HOST"] == "0.0.0.0"  # reachable through -p from outside the container
    assert parse_memory_spec(env["DETECT_GPU_MEMORY"]).mode == "cap"  # never greedy: it shares the GPU


def test_dockerignore_lets_in_what_the_dockerfile_copies():
    kept = {line[1:].strip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    copied = {shlex.split(a)[0].strip("/").split("/")[0] for k, a in instructions() if k == "COPY"}
    assert copied <= kept, copied - kept


def test_compose_runs_two_instances_on_one_gpu_each_with_its_cap_and_port():
    text = (ROOT / "compose.yaml").read_text()
    services = text.split("\nservices:\n", 1)[1]
    assert re.findall(r"^  (\w+):$", services, re.MULTILINE) == ["faces", "shapes"]
    assert len(re.findall(r"DETECT_GPU_MEMORY: (\S+)", text)) == 2
    assert sorted(re.findall(r'"(\d+):8000"', text)) == ["8001", "8002"]
    assert 'device_ids: ["0"]' in text and "driver: nvidia" in text and "capabilities: [gpu]" in text
    grace = int(re.search(r"stop_grace_period: (\d+)s", text).group(1))
    assert grace > Settings().shutdown_grace_s


def test_the_entry_command_serves_as_the_container_would(blob_model_dir, tmp_path):
    """ENTRYPOINT + CMD with the image's ENV (DETECT_MODEL and DETECT_PORT given as `docker run -e` would)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    env.update(image_env())
    env.update(DETECT_PORT=str(port), DETECT_MODEL=str(blob_model_dir))
    log_path = tmp_path / "container.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(as_here(exec_form("ENTRYPOINT") + exec_form("CMD")), cwd=ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "ready: " not in log_path.read_text() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log_path.read_text()
        assert f"listening on http://0.0.0.0:{port}" in text, text
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/readyz")
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read())["models"][0]["name"] == "blob"
        conn.close()

        healthcheck = subprocess.run(as_here(exec_form("HEALTHCHECK")), env=env, capture_output=True, timeout=30)
        assert healthcheck.returncode == 0, healthcheck.stderr
        unhealthy = subprocess.run(as_here(exec_form("HEALTHCHECK")), env={**env, "DETECT_PORT": str(_free_port())},
                                   capture_output=True, timeout=30)
        assert unhealthy.returncode != 0

        process.send_signal(getattr(signal, dict(instructions())["STOPSIGNAL"]))
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "Traceback" not in log_path.read_text()
