"""The HTTP process's side of the model workers: each worker process, and the pool that owns them all.

WorkerPool is the one owner of worker processes, as gunicorn's Arbiter is of its workers: it starts
them clean (a plain subprocess, never a fork of this threaded process), keeps `spare_workers` of them
started with TensorFlow imported, hands one out for each load, learns of every exit from the worker's
control channel (never from its log), reaps it, and stops them all at shutdown.

A WorkerProcess is one of them as seen from here: its control channel (spare, loaded, load_failed,
stats) and the models it serves, each a Member (app.models.member) with its own lanes, each lane a
socket and a shared-memory buffer that one model call at a time uses. A worker of its own serves one
member; a worker group's serves one per member model, loads and unloads them one at a time while the
others serve, and is stopped once it serves none. The model registry decides what each worker serves
and what an exit means; an exit ends every member's lanes (app.models.member says how, safely).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional

from ..errors import DetectError, ModelError, WorkerLost, WorkerNotStarted
from ..supervision import BOOT_ERROR, ExitHistory, RestartRule, describe_exit, kill_process
from .channel import Channel, ChannelClosed, SharedBuffer
from .member import Member, _Lane
from .repository import ModelVersion

log = logging.getLogger(__name__)


class WorkerProcess:
    """One worker process and the members it serves; its methods are thread-safe, and its reader reports its exit."""

    def __init__(self, process: subprocess.Popen, control: Channel,
                 on_exit: Callable[["WorkerProcess", int], None]):
        self.process = process
        self.pid = process.pid
        self.control = control
        self.started = time.monotonic()
        self.spare = threading.Event()  # set when TensorFlow is imported and it waits for a model
        self.group: Optional[str] = None  # the worker group it serves; None: a worker of its own
        self.members: dict[str, Member] = {}  # by the worker's name for each: <model>/<version>#<n>
        self.reservation: Optional[object] = None  # the budget key it holds until it has exited
        self.exit_code: Optional[int] = None
        self.expected_exit = False  # set when this side asked it to end
        self._on_exit = on_exit
        self._lock = threading.Condition()
        self._closing = False
        self._loads: dict[str, Future] = {}
        self._stats: dict[int, Future] = {}
        self._next_id = 0
        self._reader = threading.Thread(target=self._read_control, name=f"worker-{self.pid}", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        """Running, and not on its way out."""
        return self.exit_code is None and not self._closing

    @property
    def model(self) -> Optional[ModelVersion]:
        """The model version it was first given (a worker of its own serves that one only); None for a spare."""
        with self._lock:
            first = next(iter(self.members.values()), None)
        return first.model if first is not None else None

    def member_names(self) -> list[str]:
        """The models it serves now, by name."""
        with self._lock:
            return sorted({m.model.name for m in self.members.values()})

    def describe_kind(self) -> str:
        return f"group {self.group}'s worker" if self.group else "worker"

    def describe(self) -> str:
        names = self.member_names()
        if self.group:
            return f"worker {self.pid} (group {self.group}: {', '.join(names) or 'no model'})"
        model = self.model
        return f"worker {self.pid} ({f'{model.name}/{model.version}' if model is not None else 'spare'})"

    # Control channel -------------------------------------------------------------------------------

    def _read_control(self) -> None:
        while True:
            try:
                header, _, _ = self.control.receive()
            except ChannelClosed:
                break
            event = header.get("event")
            if event == "spare":
                self.spare.set()
            elif event in ("loaded", "load_failed"):
                with self._lock:
                    future = self._loads.pop(header.get("member"), None)
                if future is None:
                    continue
                if event == "loaded":
                    future.set_result(header)
                else:
                    future.set_exception(ModelError(header["error"]["message"]))
            elif event == "stats":
                future = self._stats.pop(header.get("id"), None)
                if future is not None:
                    future.set_result(header.get("tensorflow", []))
        code = self.process.wait()
        with self._lock:
            self.exit_code = code
            self._lock.notify_all()
            pending = [*self._loads.values(), *self._stats.values()]
        lost = WorkerLost(f"{self.describe()} {describe_exit(code)}")
        for future in pending:
            if not future.done():
                future.set_exception(lost)
        self.control.close()
        self._on_exit(self, code)

    def load(self, model: ModelVersion, settings: dict, lanes: int, timeout_s: float) -> Member:
        """Load a model version in this worker, beside the members it serves; wait until it is warm; return its Member.

        `settings` are the model's gpu_memory and gpus, as text (its group's: only the first load applies
        them), and what settles its precision (precision, parity_gate, threshold, max_image_pixels, and the
        choice of an earlier load of this version, if any). Raise ModelError if the model cannot be loaded (a
        worker that serves no other model then exits with BOOT_ERROR), WorkerLost if the worker dies or is
        on its way out.
        """
        mine, theirs = [], []
        for i in range(lanes):
            channel, other = Channel.pair()
            mine.append(_Lane(channel, SharedBuffer(f"detect-{model.name}-{model.version}-{i}")))
            theirs.append(other)
        fds = [fd for other, lane in zip(theirs, mine) for fd in (other.fileno(), lane.buffer.fd)]
        future: Future = Future()
        with self._lock:
            self._next_id += 1
            member = Member(self, f"{model.name}/{model.version}#{self._next_id}", model, mine)
            gone = not self.alive
            if not gone:  # else the reader has already failed the futures it saw: fail this one here
                self.members[member.ident] = member
                self._loads[member.ident] = future
        if gone:
            member.close_lanes()
            for other in theirs:
                other.close()
            why = describe_exit(self.exit_code) if self.exit_code is not None else "is stopping"
            raise WorkerLost(f"{self.describe()} {why} before it was given model {model.name}")
        try:
            self.control.send({"op": "load", "member": member.ident, "group": self.group,
                               "model": {"name": model.name, "version": model.version, "path": str(model.path),
                                         **settings}}, fds=fds)
        except ChannelClosed:
            pass  # the reader reports the exit; the future fails with WorkerLost
        finally:
            for other in theirs:
                other.close()  # the worker has its own copies now
        try:
            member.loaded = future.result(timeout=timeout_s)
        except FutureTimeout:
            self.kill(expected=False)
            raise WorkerNotStarted(f"model {model.name} version {model.version} did not load within {timeout_s:g} s "
                             "(load_timeout_s); its worker was killed") from None
        except DetectError:
            with self._lock:
                self.members.pop(member.ident, None)
                self._loads.pop(member.ident, None)
            member.close_lanes()
            raise
        return member

    def unload(self, member: Member, timeout_s: float) -> Optional[int]:
        """Unload one member (drained): its lanes close, the worker releases its TensorFlow objects.

        The worker is stopped once it serves no member; return its exit code then, else None.
        """
        member.close_lanes()
        with self._lock:
            self.members.pop(member.ident, None)
            last = not self.members
            if last:
                self._closing = True  # no member joins a worker on its way out
        if last:
            return self.stop(timeout_s)
        try:
            self.control.send({"op": "unload", "member": member.ident})
        except ChannelClosed:
            pass
        return None

    def stats(self, timeout_s: float = 1.0) -> Optional[list]:
        """Ask for TensorFlow's allocator figures; None if the worker does not answer in time."""
        future: Future = Future()
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            self._stats[ident] = future
        try:
            self.control.send({"op": "stats", "id": ident})
            return future.result(timeout=timeout_s)
        except (ChannelClosed, FutureTimeout, WorkerLost):
            return None
        finally:
            self._stats.pop(ident, None)

    # Ending ----------------------------------------------------------------------------------------

    def stop(self, timeout_s: float) -> Optional[int]:
        """Ask it to exit; kill it if it has not within `timeout_s`; return its exit code."""
        self._mark_expected()
        try:
            self.control.send({"op": "stop"})
        except ChannelClosed:
            pass
        if not self.wait(timeout_s):
            log.warning("%s did not stop within %.0f s; killing it", self.describe(), timeout_s)
            self.kill()
            self.wait(5.0)
        return self.exit_code

    def kill(self, expected: bool = True) -> None:
        """End it now (SIGKILL); `expected` False when it failed and its exit is to be handled as a crash."""
        if expected:
            self._mark_expected()
        kill_process(self.process)

    def _mark_expected(self) -> None:
        with self._lock:
            self.expected_exit = True
            self._closing = True

    def wait(self, timeout_s: float) -> bool:
        """Wait until its exit has been reaped and reported; True if it has."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.exit_code is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
        self._reader.join(max(0.0, deadline - time.monotonic()))
        return True

    def close_lanes(self) -> None:
        """Close every member's free lanes now and have the holders of the others close theirs (once it has exited)."""
        with self._lock:
            members = list(self.members.values())
        for member in members:
            member.close_lanes()

    def rss_mib(self) -> Optional[float]:
        """Return its resident memory (host RAM) in MiB, from /proc; None once it has exited."""
        return rss_mib(self.pid)


def rss_mib(pid: int) -> Optional[float]:
    """Return a process's resident memory (host RAM) in MiB, from /proc; None if it is not there."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


class WorkerPool:
    """Own every worker process: start them, keep spares, hand them out, learn of exits, stop them all."""

    def __init__(self, spares: int, log_level: str, on_exit: Callable[[WorkerProcess, int], None],
                 rule: RestartRule = RestartRule(), command: Optional[list[str]] = None):
        self.spares_wanted = spares
        self._log_level = log_level
        self._on_exit = on_exit
        self._command = command or [sys.executable, "-m", "app.models.worker"]
        self._lock = threading.Lock()
        self._spares: list[WorkerProcess] = []
        self._workers: dict[int, WorkerProcess] = {}
        self._spare_exits = ExitHistory(rule)
        self._refill_at = 0.0
        self._closed = False

    def start(self) -> None:
        """Start the spares (each imports TensorFlow, a few seconds of CPU)."""
        self.refill()

    def take(self, timeout_s: float) -> WorkerProcess:
        """Hand out a started worker for a load, waiting for its import if need be.

        Raise WorkerLost if it dies while starting, ModelError if it does not start in time or the pool is closed.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                raise WorkerNotStarted("the server is shutting down; no model is loaded now")
            ready = [w for w in self._spares if w.spare.is_set()]
            worker = ready[0] if ready else (self._spares[0] if self._spares else None)
            if worker is not None:
                self._spares.remove(worker)
        if worker is None:
            worker = self._spawn()
        while not worker.spare.wait(0.1):
            if worker.exit_code == BOOT_ERROR:  # it cannot start here, and would not on a second try
                raise WorkerNotStarted(f"{worker.describe()} cannot start: importing TensorFlow failed; see the log above")
            if worker.exit_code is not None:  # a crash, retried with backoff like any other
                raise WorkerLost(f"{worker.describe()} {describe_exit(worker.exit_code)} while starting "
                                 "(importing TensorFlow); see the log above")
            if time.monotonic() > deadline:
                worker.kill()
                raise WorkerNotStarted(f"a worker did not start within {timeout_s:g} s")
        return worker

    def refill(self) -> None:
        """Start spares until there are `spare_workers` of them (after a backoff if spares keep dying).

        The registry calls it when no load is under way: a spare's import would slow the load down.
        """
        with self._lock:
            missing = self.spares_wanted - len(self._spares)
            if self._closed or missing <= 0 or time.monotonic() < self._refill_at:
                return
            for _ in range(missing):
                self._spares.append(self._spawn_locked())

    def _spawn(self) -> WorkerProcess:
        with self._lock:
            return self._spawn_locked()

    def _spawn_locked(self) -> WorkerProcess:
        control, theirs = Channel.pair()
        try:
            process = subprocess.Popen(
                [*self._command, "--channel-fd", str(theirs.fileno()), "--log-level", self._log_level],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                # Its own session: a terminal's Ctrl-C reaches the server, which stops each worker itself.
                start_new_session=True,
            )
        finally:
            theirs.close()
        worker = WorkerProcess(process, control, self._exited)
        self._workers[worker.pid] = worker
        log.debug("started worker %d", worker.pid)
        return worker

    def _exited(self, worker: WorkerProcess, code: int) -> None:
        """Called from the worker's reader thread once its exit is reaped."""
        worker.close_lanes()
        with self._lock:
            self._workers.pop(worker.pid, None)
            was_spare = worker in self._spares
            if was_spare:
                self._spares.remove(worker)
        if was_spare and not self._closed:
            verdict = self._spare_exits.record(time.monotonic(), boot_error=code == BOOT_ERROR)
            log.error("spare %s; %s", f"worker {worker.pid} {describe_exit(code)}",
                      "no more spares are started: loads start a worker each" if verdict.give_up else verdict.reason)
            with self._lock:
                if verdict.give_up:
                    self.spares_wanted = 0
                self._refill_at = time.monotonic() + verdict.delay_s
            return
        self._on_exit(worker, code)

    def workers(self) -> list[WorkerProcess]:
        with self._lock:
            return list(self._workers.values())

    def spares(self) -> list[WorkerProcess]:
        with self._lock:
            return list(self._spares)

    def close(self, timeout_s: float) -> None:
        """Stop every worker: ask each to exit, then kill what is left after `timeout_s`."""
        with self._lock:
            self._closed = True
            workers = list(self._workers.values())
        for worker in workers:
            worker._mark_expected()
            try:
                worker.control.send({"op": "stop"})
            except ChannelClosed:
                pass
        deadline = time.monotonic() + timeout_s
        for worker in workers:
            if not worker.wait(max(0.0, deadline - time.monotonic())):
                log.warning("%s did not stop in time; killing it", worker.describe())
                worker.kill()
                worker.wait(5.0)
