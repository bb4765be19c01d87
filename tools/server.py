"""The server under test: a `python -m app serve` child, its settings file and its /proc figures.

Shared by bench, overload, soak, lifecycle, chaos and the peer comparison.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tools import ROOT


def default_model() -> Path:
    """Return models/shapes if it holds an exported version, else models/faces."""
    shapes = ROOT / "models" / "shapes"
    if any((p / "saved_model.pb").exists() for p in shapes.glob("*") if p.name.isdigit()):
        return shapes
    return ROOT / "models" / "faces"


def write_settings(path: Path, settings: dict) -> dict:
    """Write server settings as a TOML file and return every effective setting (code defaults under them)."""
    from app.settings import load_settings

    lines = []
    for key, value in settings.items():
        lines.append(f"{key} = {json.dumps(value)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    effective = load_settings(config_path=path, environ={})
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(effective).items()
            if isinstance(v, (int, float, str, tuple, type(None)))}


@dataclass
class ServerProcess:
    """A `python -m app serve` child on a free port of 127.0.0.1, and its /proc figures."""

    process: subprocess.Popen
    port: int
    log_path: Path
    grpc_port: Optional[int] = None
    _clock_ticks: int = field(default_factory=lambda: os.sysconf("SC_CLK_TCK"))

    @classmethod
    def start(cls, config: Path, log_path: Path, timeout_s: float = 300.0) -> "ServerProcess":
        """Start the server with this settings file (DETECT_* variables ignored); wait until ready."""
        from app.hosting.lifecycle import Notifications

        notifications = Notifications()  # the server says "listening" and "ready" on it
        env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
        env.update({"DETECT_PORT": "0", "DETECT_GRPC_PORT": "0", "DETECT_HOST": "127.0.0.1", "TF_CPP_MIN_LOG_LEVEL": "2",
                    "DETECT_NOTIFY_FD": str(notifications.child_fd)})
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as handle:
            process = subprocess.Popen(
                [sys.executable, "-m", "app", "serve", "--config", str(config)], cwd=ROOT, env=env,
                stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                pass_fds=[notifications.child_fd],
            )
        notifications.started()
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                listening = notifications.find("listening")
                if listening is not None and notifications.find("ready") is not None:
                    server = cls(process, listening["port"], log_path, listening.get("grpc_port"))
                    server.wait_at_rest(config, deadline)
                    return server
                if process.poll() is not None:
                    text = log_path.read_text(errors="replace")
                    raise RuntimeError(f"the server exited with status {process.returncode}:\n{text[-3000:]}")
                time.sleep(0.1)
        finally:
            notifications.close()
        process.kill()
        process.wait()
        raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s; see {log_path}")

    def wait_at_rest(self, config: Path, deadline: float) -> None:
        """Wait until the spare workers have imported TensorFlow.

        The server starts its spares after its models have loaded, and a spare's import takes seconds
        of CPU: measured under load, it would count against the service.
        """
        from app.settings import load_settings

        wanted = load_settings(config_path=config, environ={}).spare_workers
        while wanted and time.monotonic() < deadline:
            spares = self.get_json("/models").get("spares", [])
            if len(spares) >= wanted and all(spare["ready"] for spare in spares):
                return
            time.sleep(0.2)

    def get_json(self, path: str, timeout_s: float = 10.0) -> dict:
        """GET `path` from the server's HTTP port and return its JSON answer."""
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def pids(self) -> list[int]:
        """The HTTP process and its children, the model workers (and the spare)."""
        children = set()
        for task in os.listdir(f"/proc/{self.pid}/task"):
            try:
                children.update(int(c) for c in Path(f"/proc/{self.pid}/task/{task}/children").read_text().split())
            except OSError:
                continue
        return [self.pid, *sorted(children)]

    def stats(self) -> dict:
        """Return RSS (MB), threads, descriptors and CPU seconds of the server's processes, from /proc.

        The figures add up the HTTP process and its workers; `http` has the HTTP process's own. RSS
        counts pages of shared libraries once per process, so the sum overstates the memory in use.
        """
        per = [self._process_stats(pid) for pid in self.pids()]
        alive = [s for s in per if s is not None]
        total = {key: round(sum(s[key] for s in alive), 2) for key in ("rss_mb", "threads", "fds", "cpu_s")}
        return {**total, "processes": len(alive), "http": per[0]}

    def _process_stats(self, pid: int) -> Optional[dict]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            threads, fds = len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            return None  # it exited meanwhile
        found = re.search(r"^VmRSS:\s+(\d+)", status, re.M)
        if found is None:
            return None  # a zombie: it has exited, its parent has not reaped it yet
        rss_kb = int(found.group(1))
        cpu = (int(fields[11]) + int(fields[12])) / self._clock_ticks  # utime + stime
        return {"rss_mb": round(rss_kb / 1024, 1), "threads": threads, "fds": fds, "cpu_s": round(cpu, 2)}

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, wait for a clean exit (kill after timeout_s); return the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
