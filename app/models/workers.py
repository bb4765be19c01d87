"""The HTTP process's side of the model workers: each worker process, and the pool that owns them all.

WorkerPool is the one owner of worker processes, as gunicorn's Arbiter is of its workers: it starts
them clean (a plain subprocess, never a fork of this threaded process), keeps `spare_workers` of them
started with TensorFlow imported, hands one out for each load, learns of every exit from the worker's
control channel (never from its log), reaps it, and stops them all at shutdown.

A WorkerProcess is one of them as seen from here: its control channel (spare, loaded, load_failed,
stats), and once loaded its lanes, each a socket and a shared-memory buffer that one model call at a
time uses. The model registry decides what each worker serves and what an exit means.

A lane belongs to the thread that took it until it gives it back, and only that thread writes into it,
reads from it or closes it. When the worker exits, the free lanes are closed at once and each lane in
use is closed by its holder as it gives it back: an exit never pulls a buffer or a socket from under a
model call (a call copying pixels into a buffer unmapped under it took the whole server down).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import (
    DeadlineExceeded, DetectError, InferenceFailed, ModelError, OutOfMemory, WorkerLost, WorkerNotStarted,
)
from ..inference.detections import ModelOutputs, unstack_outputs
from ..supervision import BOOT_ERROR, ExitHistory, RestartRule, describe_exit, kill_process
from ..timeline import CallTimes
from .channel import Channel, ChannelClosed, NothingYet, SharedBuffer
from .repository import ModelVersion

log = logging.getLogger(__name__)

# A lane's buffer keeps up to this much between calls; a larger batch's memory is given back after it.
LANE_KEEP_BYTES = 64 * 2**20
_ERRORS = {cls.code: cls for cls in (OutOfMemory, InferenceFailed)}


@dataclass
class _Lane:
    channel: Channel
    buffer: SharedBuffer

    def close(self) -> None:
        """Close both ends on this side (only the lane's holder, or anyone once nobody holds it)."""
        self.channel.close()
        self.buffer.close()


class WorkerProcess:
    """One worker process; its methods are thread-safe, and its reader thread reports its exit."""

    def __init__(self, process: subprocess.Popen, control: Channel,
                 on_exit: Callable[["WorkerProcess", int], None]):
        self.process = process
        self.pid = process.pid
        self.control = control
        self.started = time.monotonic()
        self.spare = threading.Event()  # set when TensorFlow is imported and it waits for a model
        self.model: Optional[ModelVersion] = None
        self.loaded: Optional[dict] = None  # signature, max_batch, policy, seconds: from its `loaded` message
        self.reservation: Optional[object] = None  # the budget key it holds until it has exited
        self.reserved_at: Optional[float] = None  # when that budget was had: its model's load costs from there
        self.exit_code: Optional[int] = None
        self.expected_exit = False  # set when this side asked it to end
        self._on_exit = on_exit
        self._lock = threading.Condition()
        self._free_lanes: list[_Lane] = []  # lanes no call holds; the others are their holders'
        self._lanes_closed = False  # set once it has exited: no lane is handed out again
        self._calls = 0
        self._closing = False
        self._load: Optional[Future] = None
        self._stats: dict[int, Future] = {}
        self._next_id = 0
        self._reader = threading.Thread(target=self._read_control, name=f"worker-{self.pid}", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        """Running, and not on its way out."""
        return self.exit_code is None and not self._closing

    @property
    def calls(self) -> int:
        """Model calls on its lanes now."""
        with self._lock:
            return self._calls

    def describe(self) -> str:
        what = f"{self.model.name}/{self.model.version}" if self.model is not None else "spare"
        return f"worker {self.pid} ({what})"

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
            elif event in ("loaded", "load_failed") and self._load is not None:
                if event == "loaded":
                    self._load.set_result(header)
                else:
                    self._load.set_exception(ModelError(header["error"]["message"]))
            elif event == "stats":
                future = self._stats.pop(header.get("id"), None)
                if future is not None:
                    future.set_result(header.get("tensorflow", []))
        code = self.process.wait()
        with self._lock:
            self.exit_code = code
            self._lock.notify_all()
        lost = WorkerLost(f"{self.describe()} {describe_exit(code)}")
        for future in [self._load, *self._stats.values()]:
            if future is not None and not future.done():
                future.set_exception(lost)
        self.control.close()
        self._on_exit(self, code)

    def load(self, model: ModelVersion, settings: dict, lanes: int, timeout_s: float) -> dict:
        """Give this spare a model; wait until it is loaded and warm; return its `loaded` message.

        `settings` are the model's gpu_memory and gpus, as text, and what settles its precision (precision,
        parity_gate, threshold, max_image_pixels, and the choice of an earlier load of this version, if any). Raise ModelError if the model cannot be
        loaded (the worker then exits with BOOT_ERROR), WorkerLost if the worker dies.
        """
        self.model = model
        mine, theirs = [], []
        for i in range(lanes):
            channel, other = Channel.pair()
            mine.append(_Lane(channel, SharedBuffer(f"detect-{model.name}-{model.version}-{i}")))
            theirs.append(other)
        fds = [fd for other, lane in zip(theirs, mine) for fd in (other.fileno(), lane.buffer.fd)]
        with self._lock:
            gone = self.exit_code is not None
            if not gone:  # else the reader has already failed the futures it saw: fail this one here
                self._load = Future()
                self._free_lanes.extend(mine)
        if gone:
            for lane, other in zip(mine, theirs):
                lane.close()
                other.close()
            raise WorkerLost(f"{self.describe()} {describe_exit(self.exit_code)} before it was given the model")
        try:
            self.control.send({"op": "load", "model": {"name": model.name, "version": model.version,
                                                       "path": str(model.path), **settings}}, fds=fds)
        except ChannelClosed:
            pass  # the reader reports the exit; the future fails with WorkerLost
        finally:
            for other in theirs:
                other.close()  # the worker has its own copies now
        try:
            self.loaded = self._load.result(timeout=timeout_s)
        except FutureTimeout:
            self.kill(expected=False)
            raise WorkerNotStarted(f"model {model.name} version {model.version} did not load within {timeout_s:g} s "
                             "(load_timeout_s); its worker was killed") from None
        return self.loaded

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

    # Model calls -----------------------------------------------------------------------------------

    def run(self, images: Sequence[np.ndarray], observe: Optional[Callable[[int, float, int], None]] = None,
            call: Optional[CallTimes] = None, deadline: Optional[float] = None) -> list["ModelOutputs | DetectError"]:
        """Run one model call on same-shaped images; return one result or error per image.

        Called from a request's thread or the model's batching threads. The batch is stacked straight into
        the lane's shared buffer. `observe(images, seconds, out_of_memory)` gets the worker's own timing of
        the call, and `call` the marks of its stages. Raise WorkerLost if the worker is gone or goes away
        during the call, DeadlineExceeded when `deadline` (time.monotonic()) passes first: a worker that is
        stopped or stuck holds its lanes, never the caller.
        """
        call = call or CallTimes()
        call.dispatched = time.monotonic()
        with self._lock:
            if not self.alive:
                raise WorkerLost(f"{self.describe()} is not taking calls")
            self._calls += 1
        try:
            lane = self._take_lane(deadline)
            try:
                shape = _fill(lane.buffer, images)
            except BaseException:  # nothing was sent: the lane is as it was
                self._give_back(lane, broken=False)
                raise
            try:
                header, arrays = self._exchange(lane, shape, deadline)
            except DeadlineExceeded:
                self._answer_later(lane)
                raise
            except BaseException:
                self._give_back(lane, broken=True)
                raise
            self._give_back(lane, broken=False)
        finally:
            with self._lock:
                self._calls -= 1
                self._lock.notify_all()
        if observe is not None:
            observe(len(images), header.get("seconds", 0.0), header.get("out_of_memory", 0))
        good = iter(unstack_outputs(arrays))
        results = [next(good) if error is None else _ERRORS.get(error["code"], InferenceFailed)(error["message"])
                   for error in header["errors"]]
        call.received, call.answered = header.get("received", 0.0), header.get("answered", 0.0)
        call.read = time.monotonic()
        return results

    def _exchange(self, lane: _Lane, shape: tuple, deadline: Optional[float] = None,
                  sent: bool = False) -> tuple[dict, dict]:
        """Ask the worker to run the batch in the lane's buffer (unless `sent`) and read its answer.

        A lane that broke or fell out of step leaves the worker unusable: end it, so that a successor
        takes over, and raise WorkerLost. Raise DeadlineExceeded, the lane still in step, if no answer has
        begun to arrive by `deadline`.
        """
        try:
            if not sent:
                lane.channel.send({"op": "run", "shape": list(shape)})
            try:
                header, arrays, _ = lane.channel.receive(
                    None if deadline is None else deadline - time.monotonic())
            except NothingYet:
                raise DeadlineExceeded(f"{self.describe()} had not answered the model call when the request's "
                                       "deadline passed") from None
            return header, arrays
        except ChannelClosed as exc:
            self.kill(expected=False)
            raise WorkerLost(f"{self.describe()} went away during a model call ({exc})") from None
        except (ValueError, KeyError) as exc:  # a message that is not the channel's format
            self.kill(expected=False)
            raise WorkerLost(f"{self.describe()} sent an unreadable answer ({exc}); it was ended") from None

    def _take_lane(self, deadline: Optional[float] = None) -> _Lane:
        """Take a free lane, waiting for one; raise WorkerLost once the worker has exited, DeadlineExceeded
        when `deadline` passes first."""
        with self._lock:
            while not self._free_lanes:
                if self._lanes_closed or self.exit_code is not None:
                    raise WorkerLost(f"{self.describe()} went away before the call had a lane")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceeded(f"every lane of {self.describe()} was busy until the request's deadline")
                self._lock.wait(remaining)
            return self._free_lanes.pop()

    def _answer_later(self, lane: _Lane) -> None:
        """A call whose deadline passed still owes its answer: a thread of its own waits for it and frees the lane.

        Its caller has moved on. The answer is dropped; the lane is given back in step, or closed with the
        worker ended if the answer never comes whole. At most one such thread per lane.
        """
        def wait_for_answer() -> None:
            try:
                self._exchange(lane, (), sent=True)
            except BaseException:
                self._give_back(lane, broken=True)
                return
            self._give_back(lane, broken=False)

        threading.Thread(target=wait_for_answer, name=f"late-answer-{self.pid}", daemon=True).start()

    def _give_back(self, lane: _Lane, broken: bool) -> None:
        """Return a lane after a call (its holder); close it instead if it broke or the worker has exited.

        A broken lane is not shrunk: a worker on its way out may still be reading it.
        """
        if not broken:
            lane.buffer.shrink(LANE_KEEP_BYTES)
        with self._lock:
            keep = not broken and not self._lanes_closed
            if keep:
                self._free_lanes.append(lane)
                self._lock.notify_all()
        if not keep:
            lane.close()

    # Ending ----------------------------------------------------------------------------------------

    def drain(self, timeout_s: float) -> bool:
        """Take no new calls; wait until the calls on it are done; True if they were in time."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._closing = True
            while self._calls and self.exit_code is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True

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
        """Close the free lanes now and have the holders of the others close theirs (once it has exited)."""
        with self._lock:
            self._lanes_closed = True
            free, self._free_lanes = self._free_lanes, []
            self._lock.notify_all()  # calls waiting for a lane fail with WorkerLost
        for lane in free:
            lane.close()

    def rss_mib(self) -> Optional[float]:
        """Return its resident memory (host RAM) in MiB, from /proc; None once it has exited."""
        return rss_mib(self.pid)


def _fill(buffer: SharedBuffer, images: Sequence[np.ndarray]) -> tuple:
    """Stack same-shaped images into a lane's buffer (the one copy); return the batch's shape."""
    shape = (len(images), *images[0].shape)
    batch = buffer.array(shape, grow=True)
    if len(images) == 1:
        batch[0] = images[0]
    else:
        np.stack(images, out=batch)
    return shape


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
