"""A newcomer's first hour works exactly as written.

In a fresh clone in an empty folder, with nothing made beforehand: `scripts/run` builds `.venv` as it
always does (the project without the test extras; pip may use its cache) and serves on the README's own
port, 8000. Then every runnable command of the README and the tutorials (the `<!-- test: run -->` blocks
that tests/test_docs.py also runs, parsed by its parser) is typed there as written, in order, with the
clone's own `.venv` and the committed samples, and each answer must have the shape the page shows. While
that server serves, a second and a third `scripts/run` start with nothing but `DETECT_PORT` changed, and
all three answer. It prints how long the set-up took, from the clone to the first answer.

Skipped, saying why, when port 8000, 8001 or 8002 is taken, or when the package index cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT
from test_docs import failing_on_http_errors, parse_shown, runnable_blocks, shape_differences

PORTS = (8000, 8001, 8002)  # the README's, then the two that the tutorial's servers side by side take
PAGES = ["README.md", "docs/tutorials/first-detection.md", "docs/tutorials/sharing-a-gpu.md",
         "docs/tutorials/your-own-model.md"]
SETUP_TIMEOUT_S = 1500.0  # a venv with TensorFlow from an empty pip cache, then three models loaded
READY_TIMEOUT_S = 300.0
# Until the gRPC port is off by default (issue 36, the code side), the first server takes 8001 for gRPC,
# where the second one's HTTP goes; drop this line when that lands.
OFFLINE = ("Failed to establish a new connection", "Temporary failure in name resolution",
           "No matching distribution found", "Could not find a version that satisfies")


def port_taken(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def answers(port: int, path: str = "/readyz") -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


class Instance:
    """One `scripts/run` in the clone, as a newcomer starts it, its output in a log file."""

    def __init__(self, clone: Path, log: Path, env: dict[str, str]):
        self.log = log
        with log.open("wb") as handle:
            self.process = subprocess.Popen([str(clone / "scripts" / "run")], cwd=clone, env=env, stdout=handle,
                                            stderr=subprocess.STDOUT)

    def wait_ready(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if answers(port) == 200:
                return
            if self.process.poll() is not None:
                text = self.log.read_text(errors="replace")
                if any(sign in text for sign in OFFLINE):
                    pytest.skip(f"scripts/run could not reach the package index:\n{text[-1500:]}")
                raise AssertionError(f"scripts/run on {port} exited {self.process.returncode}:\n{text[-4000:]}")
            time.sleep(1.0)
        raise AssertionError(f"scripts/run on {port} was not ready in {timeout:.0f} s:\n"
                             f"{self.log.read_text(errors='replace')[-4000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # scripts/run execs the server: this pid is the server
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def newcomer_env() -> dict[str, str]:
    """The environment of someone who has just cloned it: no DETECT_* settings, no venv of ours on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DETECT_", "PYTHON", "VIRTUAL_ENV", "TF_CPP"))}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


def run_block_step(command: str, clone: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=180)


def test_a_fresh_clone_runs_the_readme_and_the_tutorials_as_written(tmp_path, capsys):
    taken = [port for port in PORTS if port_taken(port)]
    if taken:
        pytest.skip(f"port(s) {taken} taken here: the README's commands name 8000, and the second and third "
                    "servers take 8001 and 8002")
    started = time.monotonic()
    clone = tmp_path / "gpu-share-detect"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    env = newcomer_env()
    instances: list[Instance] = []
    try:
        first = Instance(clone, tmp_path / "run-8000.log", env)
        instances.append(first)
        first.wait_ready(8000, SETUP_TIMEOUT_S)
        setup_s = time.monotonic() - started
        with capsys.disabled():
            print(f"\nnewcomer: from a fresh clone to the first answer on :8000 took {setup_s:.0f} s "
                  f"(the venv built by scripts/run, then every model loaded)")

        ran = 0
        for page in PAGES:
            for block in runnable_blocks(clone / page, clone):
                where = f"{page}:{block.line}"
                if block.lang == "python":
                    result = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c", block.body], cwd=clone,
                                            env=env, capture_output=True, text=True, timeout=180)
                    assert result.returncode == 0, f"{where}: the Python example failed:\n{result.stderr[-3000:]}"
                    ran += 1
                    continue
                for step in block.steps():
                    expected = int(block.options.get("exit", 0))
                    command = failing_on_http_errors(step.command) if expected == 0 else step.command
                    result = run_block_step(command, clone, env)
                    ran += 1
                    assert result.returncode == expected, (
                        f"{where}: `{step.command.strip()}` exited {result.returncode}, not {expected}:\n"
                        f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
                    if not step.shown.strip():
                        continue
                    shown = parse_shown(step.shown)
                    if shown is None:
                        assert step.shown.strip() == (result.stdout + result.stderr).strip(), where
                        continue
                    try:
                        actual = json.loads(result.stdout)
                    except ValueError:
                        raise AssertionError(f"{where}: `{step.command.strip()}` printed no JSON:\n"
                                             f"{result.stdout[-2000:]}{result.stderr[-2000:]}") from None
                    differences = shape_differences(shown, actual)
                    assert not differences, f"{where}: `{step.command.strip()}` answers in another shape: {differences}"
        assert ran >= 8, f"only {ran} commands found on {PAGES}"

        # Servers side by side, nothing but the HTTP port changed, while the first serves.
        for port in PORTS[1:]:
            instances.append(Instance(clone, tmp_path / f"run-{port}.log", {**env, "DETECT_PORT": str(port)}))
        for instance, port in zip(instances[1:], PORTS[1:]):
            instance.wait_ready(port, READY_TIMEOUT_S)
        for port in PORTS:
            assert answers(port, "/models") == 200, f"the server on {port} does not answer"
    finally:
        for instance in reversed(instances):
            instance.stop()


def test_every_console_block_of_the_readme_and_the_tutorials_is_run():
    """A `$ ` command a newcomer may copy is one that the test above types: no console block goes unmarked."""
    for page in PAGES:
        text = (ROOT / page).read_text()
        consoles = len(re.findall(r"^```console$", text, re.MULTILINE))
        marked = sum(block.lang == "console" for block in runnable_blocks(ROOT / page))
        assert consoles == marked, f"{page}: {consoles - marked} console block(s) without <!-- test: run -->"
