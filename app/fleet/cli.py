"""`python -m app fleet`: budget a fleet of instances onto the GPUs, run each as its own process, keep them up.

Each instance is `python -m app serve` in a child process, configured by DETECT_* variables. Before
anything starts, the plan is checked (fleet_plan): each GPU's caps plus one overhead per instance
must fit. Then the fleet writes a state file (fleet_state) that the instances' /gpu reads, waits
for each /readyz, prints a table, restarts an instance that exits (with backoff) and gives it up
after max_failures exits in failure_window_s; the others keep running. SIGTERM or SIGINT stop every
instance gracefully (each drains and exits 0), then the fleet exits 0.

Exit status: 0 after a stop, 1 when every instance has been given up, 2 for a bad fleet file or a
plan that does not fit.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from ..errors import ConfigError, NvmlUnavailable
from ..gpu.budget import Gpu, inventory
from ..hosting.lifecycle import PROBE_USER_AGENT, Notifications
from ..settings import env_name, load_settings
from ..supervision import BOOT_ERROR, ExitHistory, RestartRule, describe_exit
from .plan import FleetConfig, InstanceSpec, Plan, format_table, load_fleet, make_plan, planning_gpus
from .state import FleetState, InstanceState, write_state

log = logging.getLogger("app.fleet")

POLL_S = 0.2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app fleet",
        description="Start the instances a fleet file describes, each as its own process, inside a GPU budget.",
    )
    parser.add_argument("--config", type=Path, required=True, help="fleet file (TOML), e.g. config/fleet.toml")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit: 0 if it fits, 2 if not")
    parser.add_argument("--gpu-total-mib", type=_positive_int, default=None, metavar="N",
                        help="plan against GPUs of N MiB instead of asking NVML (to plan for another machine)")
    parser.add_argument("--state", type=Path, default=None, metavar="FILE",
                        help="where to write the fleet state file the instances read "
                             "(default: a temporary folder, removed at exit)")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of MiB above 0, not {text!r}")
    return value


def main(argv: list[str]) -> int:
    """Parse flags, plan, and run the fleet until stopped; return the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_fleet(args.config)
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    gpus, nvml_reason = gpu_inventory(config, args.gpu_total_mib)
    plan = make_plan(config, gpus)
    print(plan.table())
    for budget in plan.budgets:
        print(budget.describe())
    if gpus is None:
        print(f"note: no GPU inventory ({nvml_reason}); the budget is not checked. "
              "Pass --gpu-total-mib to plan for a GPU of that size.", file=sys.stderr)
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for error in plan.errors:
        print(f"error: {error}", file=sys.stderr)
    sys.stdout.flush()
    base_env = dict(os.environ)  # handed on to the children, who read their settings from it
    try:
        for instance in config.instances:
            check_instance_settings(instance, base_env)
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if plan.errors:
        return 2
    if args.dry_run:
        return 0
    temporary = None
    state_path = args.state
    if state_path is None:
        temporary = Path(tempfile.mkdtemp(prefix="detect-fleet-"))
        state_path = temporary / "state.json"
    if args.gpu_total_mib is not None:  # the plan was made for another machine; what does this one have?
        nvml_reason = gpu_inventory(config, None)[1]
    try:
        return run_fleet(config, plan, state_path, base_env, gpu_reason=nvml_reason)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)


def gpu_inventory(config: FleetConfig, total_mib: Optional[int],
                  nvml_library=None) -> tuple[Optional[list[Gpu]], Optional[str]]:
    """Return the GPUs to plan on and, where there are none, why: `--gpu-total-mib`, else NVML."""
    if total_mib is not None:
        return planning_gpus(config, total_mib), None
    from ..gpu.nvml import Nvml

    try:
        nvml = Nvml.open(nvml_library)
    except NvmlUnavailable as exc:
        return None, f"NVML: {exc.message}"
    try:
        devices = nvml.snapshot()
    except NvmlUnavailable as exc:
        return None, f"NVML: {exc.message}"
    finally:
        nvml.close()
    if not devices:
        return None, "NVML sees no GPU"
    return inventory(devices), None


def child_env(instance: InstanceSpec, base_env: dict, state_path: Optional[Path] = None,
              notify_fd: int = -1) -> dict:
    """Return the environment of an instance's process: the fleet's, then the instance's settings."""
    env = dict(base_env)
    env.update(instance.env())
    env[env_name("instance_name")] = instance.name
    env[env_name("fleet_state")] = str(state_path) if state_path is not None else ""
    env[env_name("notify_fd")] = str(notify_fd)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def check_instance_settings(instance: InstanceSpec, base_env: dict) -> None:
    """Build the settings the instance will boot with, so a bad one stops the fleet before it starts."""
    try:
        load_settings(environ=child_env(instance, base_env))
    except ConfigError as exc:
        raise ConfigError(f"instance {instance.name!r}: {exc.message}") from None


class Child:
    """One instance and its current process; used by the supervisor's thread only, but for `bound_port`."""

    def __init__(self, spec: InstanceSpec, caps: dict, cap_text: str, rule: RestartRule):
        self.spec = spec
        self.caps = caps
        self.cap_text = cap_text
        self.process: Optional[subprocess.Popen] = None
        self.reader: Optional[threading.Thread] = None
        self.notifications: Optional[Notifications] = None
        self.bound_host = spec.host  # set from the instance's "listening" event, with bound_port
        self.bound_port: Optional[int] = None
        self.state = "starting"
        self.restarts = 0
        self.exits = ExitHistory(rule)
        self.started_at = 0.0
        self.restart_at: Optional[float] = None
        self.timed_out = False

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process is not None and self.state not in ("restarting", "failed",
                                                                                    "stopped") else None

    @property
    def port(self) -> Optional[int]:
        return self.bound_port or self.spec.port or None


class Fleet:
    """Start, watch and stop the instances of a plan; every method runs in one thread (the main one)."""

    def __init__(self, config: FleetConfig, plan: Plan, state_path: Path, base_env: dict,
                 command: Optional[list[str]] = None, out=None, err=None):
        self.config = config
        self.state_path = Path(state_path)
        self.base_env = base_env
        self.command = command or [sys.executable, "-m", "app", "serve"]
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self._write_lock = threading.Lock()
        rule = RestartRule(config.max_failures, config.failure_window_s, config.restart_backoff_s)
        self.children = [Child(i, plan.caps_for(i.name), plan.cap_text(i.name), rule) for i in config.instances]
        self._saved: Optional[list] = None
        self._printed: Optional[list] = None
        self.caps_warned = False

    def start_all(self) -> None:
        for child in self.children:
            self._start(child)
        self.save()

    def _start(self, child: Child) -> None:
        child.bound_host, child.bound_port = child.spec.host, None
        child.timed_out = False
        if child.notifications is not None:
            child.notifications.close()
        child.notifications = Notifications()  # the instance says "listening" (its port) and "ready" on it
        try:
            child.process = subprocess.Popen(
                self.command,
                env=child_env(child.spec, self.base_env, self.state_path, notify_fd=child.notifications.child_fd),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                pass_fds=[child.notifications.child_fd],
                process_group=0,  # a terminal's Ctrl-C reaches the fleet alone; the fleet stops each instance once
            )
        finally:
            child.notifications.started()
        child.state = "starting"
        child.started_at = time.monotonic()
        child.restart_at = None
        child.reader = threading.Thread(target=self._forward, args=(child, child.process),
                                        name=f"fleet-{child.spec.name}", daemon=True)
        child.reader.start()
        log.info("instance %s: started as pid %d (%s, %s)", child.spec.name, child.process.pid,
                 child.spec.model, child.cap_text)

    def _forward(self, child: Child, process: subprocess.Popen) -> None:
        """Copy an instance's output to the fleet's stderr, each line prefixed; runs in a reader thread."""
        prefix = f"{child.spec.name} | "
        for line in iter(process.stdout.readline, b""):
            with self._write_lock:
                self.err.write(prefix + line.decode(errors="replace").rstrip("\n") + "\n")
                self.err.flush()
        process.stdout.close()



    def poll(self) -> None:
        """Reap exits, start due restarts, probe readiness, and save or print what changed."""
        now = time.monotonic()
        for child in self.children:
            if child.state in ("starting", "ready") and child.process.poll() is not None:
                self._exited(child, child.process.returncode, now)
            elif child.state == "restarting" and now >= child.restart_at:
                child.restarts += 1
                self._start(child)
            elif child.state == "starting":
                self._probe(child, now)
        self.save()
        if self.settled():
            self.print_table()

    def _probe(self, child: Child, now: float) -> None:
        listening = child.notifications.find("listening")
        if listening is not None:
            child.bound_host, child.bound_port = str(listening["host"]), int(listening["port"])
        if child.bound_port is not None and _get(child.bound_host, child.bound_port, "/readyz",
                                                 {"User-Agent": PROBE_USER_AGENT})[0] == 200:
            child.state = "ready"
            log.info("instance %s: ready on port %d (pid %d)%s", child.spec.name, child.bound_port,
                     child.process.pid, f" after {child.restarts} restart(s)" if child.restarts else "")
            self._check_caps(child)
        elif now - child.started_at > self.config.ready_timeout_s and not child.timed_out:
            log.error("instance %s: not ready after %.0f s; killing it", child.spec.name,
                      self.config.ready_timeout_s)
            child.timed_out = True
            child.process.kill()

    def _check_caps(self, child: Child) -> None:
        # The instance knows best whether its TensorFlow sees a GPU (a CPU build beside a driver does not).
        if self.caps_warned or child.spec.gpus == ():
            return
        status, body = _get(child.bound_host, child.bound_port, "/gpu")
        policy = body.get("policy", {}) if status == 200 and isinstance(body, dict) else {}
        if policy and not policy.get("gpus"):
            self.say_caps_not_enforced(f"instance {child.spec.name}: {policy.get('note')}")

    def say_caps_not_enforced(self, why: str) -> None:
        """Say once that the caps cannot be enforced here, and why."""
        if not self.caps_warned:
            self.caps_warned = True
            log.warning("no GPU for the instances here (%s): they run on the CPU, and their caps cannot be "
                        "enforced on this host", why)

    def _exited(self, child: Child, code: int, now: float) -> None:
        name = child.spec.name
        how = describe_exit(code) + (" (not ready in time)" if child.timed_out else "")
        verdict = child.exits.record(now, boot_error=code == BOOT_ERROR and not child.timed_out)
        if verdict.give_up:
            child.state = "failed"
            log.error("instance %s (pid %d) %s: %s%s; giving it up, the other instances keep running", name,
                      child.process.pid, how, verdict.reason,
                      " (see its log above)" if code == BOOT_ERROR and not child.timed_out else "")
        else:
            child.state = "restarting"
            child.restart_at = now + verdict.delay_s
            log.warning("instance %s (pid %d) %s; %s", name, child.process.pid, how, verdict.reason)

    def settled(self) -> bool:
        return all(c.state in ("ready", "failed") for c in self.children)

    def all_failed(self) -> bool:
        return all(c.state == "failed" for c in self.children)

    def rows(self) -> list[list[str]]:
        return [
            [c.spec.name, str(c.port or "-"), c.spec.model, c.cap_text, str(c.pid or "-"), c.state]
            for c in self.children
        ]

    def print_table(self) -> None:
        rows = self.rows()
        if rows != self._printed:
            self._printed = rows
            with self._write_lock:
                print(format_table(["instance", "port", "model", "cap", "pid", "state"], rows), file=self.out)
                self.out.flush()

    def state(self) -> FleetState:
        return FleetState(
            fleet_pid=os.getpid(), gpu_overhead_mib=self.config.gpu_overhead_mib,
            instances=tuple(
                InstanceState(name=c.spec.name, port=c.port or 0, model=c.spec.model,
                              gpu_memory=str(c.spec.gpu_memory), caps_mib=c.caps, pid=c.pid, state=c.state,
                              restarts=c.restarts)
                for c in self.children
            ),
        )

    def save(self) -> None:
        """Write the state file if anything in it changed."""
        state = self.state()
        current = [i.to_json() for i in state.instances]
        if current != self._saved:
            write_state(self.state_path, state)
            self._saved = current

    def stop(self) -> bool:
        """Stop every running instance with SIGTERM, then SIGKILL what is left; True if all stopped in time."""
        running = [c for c in self.children if c.state in ("starting", "ready") and c.process.poll() is None]
        for child in running:
            child.state = "stopping"
            child.process.send_signal(signal.SIGTERM)
        self.save()
        deadline = time.monotonic() + self.config.stop_timeout_s
        graceful = True
        for child in running:
            try:
                code = child.process.wait(max(0.0, deadline - time.monotonic()))
                log.info("instance %s (pid %d): stopped, exit status %d", child.spec.name, child.process.pid, code)
            except subprocess.TimeoutExpired:
                graceful = False
                log.error("instance %s (pid %d): still running %g s after SIGTERM; killing it", child.spec.name,
                          child.process.pid, self.config.stop_timeout_s)
                child.process.kill()
                child.process.wait()
        for child in self.children:
            if child.reader is not None:
                child.reader.join(5)
            if child.notifications is not None:
                child.notifications.close()
            child.state = "stopped"
        self.save()
        return graceful


def run_fleet(config: FleetConfig, plan: Plan, state_path: Path, base_env: dict,
              gpu_reason: Optional[str] = None) -> int:
    """Run the fleet until SIGTERM or SIGINT, or until every instance is given up."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    fleet = Fleet(config, plan, state_path, base_env)
    status = 0
    try:
        if gpu_reason is not None:
            fleet.say_caps_not_enforced(gpu_reason)
        log.info("fleet %d: %d instance(s), state file %s", os.getpid(), len(fleet.children), state_path)
        fleet.start_all()
        while not stop.is_set():
            fleet.poll()
            if fleet.all_failed():
                log.error("every instance has been given up; the fleet exits")
                status = 1
                break
            stop.wait(POLL_S)
        if stop.is_set():
            log.info("stopping: SIGTERM to every instance, waiting up to %g s", config.stop_timeout_s)
    finally:
        graceful = fleet.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("fleet stopped%s", "" if graceful else " (some instances had to be killed)")
    return status


def _get(host: str, port: int, path: str, headers: Optional[dict] = None,
         timeout: float = 2.0) -> tuple[Optional[int], object]:
    """GET a path of an instance; return (status, parsed JSON body) or (None, None) if it does not answer."""
    address = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    conn = http.client.HTTPConnection(address, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
    except (OSError, http.client.HTTPException):
        return None, None
    finally:
        conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, None
