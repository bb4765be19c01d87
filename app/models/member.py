"""One model served by a worker process, as the HTTP process sees it: its lanes, its calls, its drain.

A worker of its own has one Member; a worker group's worker has one per member model (and, while a
member's new version takes over, one for each version). A ServedModel calls its Member as it called its
worker before groups: `run`, `drain`, `stop`; the process itself (its control channel, its exit, its
budget) is the Member's `process`, a WorkerProcess of app.models.workers.

A lane belongs to the thread that took it until it gives it back, and only that thread writes into it,
reads from it or closes it. When the worker exits, or the member is unloaded, the free lanes are closed
at once and each lane in use is closed by its holder as it gives it back: an exit never pulls a buffer
or a socket from under a model call (a call copying pixels into a buffer unmapped under it took the
whole server down).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from ..errors import DeadlineExceeded, DetectError, InferenceFailed, OutOfMemory, WorkerLost
from ..inference.detections import ModelOutputs, unstack_outputs
from ..timeline import CallTimes
from .channel import Channel, ChannelClosed, NothingYet, SharedBuffer
from .repository import ModelVersion

if TYPE_CHECKING:
    from .workers import WorkerProcess

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


class Member:
    """One model version in a worker process: its lanes and calls; thread-safe."""

    def __init__(self, process: "WorkerProcess", ident: str, model: ModelVersion, lanes: list[_Lane]):
        self.process = process
        self.pid = process.pid
        self.ident = ident  # the worker's name for it: <model>/<version>#<n>
        self.model = model
        self.loaded: Optional[dict] = None  # signature, max_batch, policy, seconds: from its `loaded` message
        self.reserved_at: Optional[float] = None  # when its load could begin (the budget had): its load costs from there
        self._lock = threading.Condition()
        self._free_lanes = list(lanes)  # lanes no call holds; the others are their holders'
        self._lanes_closed = False  # set once it is unloaded or its worker exited: no lane is handed out again
        self._calls = 0
        self._closing = False

    @property
    def alive(self) -> bool:
        """Its worker runs and takes calls for it."""
        return self.process.alive and not self._closing

    @property
    def expected_exit(self) -> bool:
        return self.process.expected_exit

    @property
    def reservation(self) -> Optional[object]:
        return self.process.reservation

    @property
    def calls(self) -> int:
        """Model calls on its lanes now."""
        with self._lock:
            return self._calls

    def describe(self) -> str:
        return f"{self.process.describe_kind()} {self.pid} ({self.model.name}/{self.model.version})"

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

        A lane that broke or fell out of step leaves the worker unusable: end it (every member of its group
        with it), so that a successor takes over, and raise WorkerLost. Raise DeadlineExceeded, the lane
        still in step, if no answer has begun to arrive by `deadline`.
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
            if not self._lanes_closed:  # its own unload closes its lanes; anything else is the worker's end
                self.process.kill(expected=False)
            raise WorkerLost(f"{self.describe()} went away during a model call ({exc})") from None
        except (ValueError, KeyError) as exc:  # a message that is not the channel's format
            self.process.kill(expected=False)
            raise WorkerLost(f"{self.describe()} sent an unreadable answer ({exc}); it was ended") from None

    def _take_lane(self, deadline: Optional[float] = None) -> _Lane:
        """Take a free lane, waiting for one; raise WorkerLost once the worker has exited, DeadlineExceeded
        when `deadline` passes first."""
        with self._lock:
            while not self._free_lanes:
                if self._lanes_closed or self.process.exit_code is not None:
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
        """Return a lane after a call (its holder); close it instead if it broke or the member has ended.

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
            while self._calls and self.process.exit_code is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True

    def stop(self, timeout_s: float) -> Optional[int]:
        """Unload it from its worker; the worker exits once it holds no member. Return its exit code if it did."""
        with self._lock:
            self._closing = True
        return self.process.unload(self, timeout_s)

    def kill(self, expected: bool = True) -> None:
        """End its worker now (SIGKILL), every member of its group with it."""
        self.process.kill(expected)

    def wait(self, timeout_s: float) -> bool:
        return self.process.wait(timeout_s)

    def close_lanes(self) -> None:
        """Close the free lanes now and have the holders of the others close theirs (unloaded, or its worker exited)."""
        with self._lock:
            self._lanes_closed = True
            self._closing = True
            free, self._free_lanes = self._free_lanes, []
            self._lock.notify_all()  # calls waiting for a lane fail with WorkerLost
        for lane in free:
            lane.close()

    def rss_mib(self) -> Optional[float]:
        """Return its worker's resident memory (host RAM) in MiB; shared with its group's other members."""
        return self.process.rss_mib()

    def stats(self, timeout_s: float = 1.0) -> Optional[list]:
        return self.process.stats(timeout_s)


def _fill(buffer: SharedBuffer, images: Sequence[np.ndarray]) -> tuple:
    """Stack same-shaped images into a lane's buffer (the one copy); return the batch's shape."""
    shape = (len(images), *images[0].shape)
    batch = buffer.array(shape, grow=True)
    if len(images) == 1:
        batch[0] = images[0]
    else:
        np.stack(images, out=batch)
    return shape
