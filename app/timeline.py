"""Where one inference request's time goes, stage by stage, across the threads and the worker it crosses.

Each stage is timed by the thread that ends it, from time.monotonic() (one clock for every process on
the machine, so the worker's own marks line up with the HTTP process's). The stages follow one another
without gaps, so they add up to the request's time in the server. A request of several images reports
the stages of the image answered last, the one it waited for.

`STAGES` is the catalogue: the Prometheus histogram `detect_request_stage_seconds{model, stage}` and
`timing_ms.stages` of /detect (`?timing=stages`) use these names, and the metrics reference lists them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

STAGES = {
    "receive": "from the request's first body byte to its handler starting in a request thread (the body's "
               "arrival and the hand-off from the I/O thread)",
    "decode": "reading the images from the body and decoding them",
    "load": "waiting for the model to load or restart (absent when it was ready)",
    "queue": "waiting in the model's queue for a batching thread to take the image",
    "batch": "waiting for more images to share the call (max_batch_delay_ms)",
    "send": "stacking the batch into the lane's shared memory and the hand-off to the worker",
    "inference": "the model call in the worker, as the worker timed it",
    "return": "the hand-back: the answer's arrays over the lane, read and split per image",
    "wake": "from the answer being ready to the request's thread running again",
    "encode": "building the answer's body (boxes, labels, JSON or binary)",
    "write": "from the body being built to its last byte handed to the socket, in the I/O thread",
}

# WSGI environ keys: when the body began to arrive (set by the I/O thread), and (model, timeline) once the app
# has answered, for the I/O thread to add `write` and observe the stages.
RECEIVED_KEY = "detect.received"
TIMELINE_KEY = "detect.timeline"


@dataclass
class CallTimes:
    """One model call's marks (time.monotonic()): filled by the thread that makes the call."""

    dispatched: float = 0.0  # the call begins: stacking into the lane
    received: float = 0.0  # the worker has the batch (the worker's mark)
    answered: float = 0.0  # the worker has its answer and starts sending it (the worker's mark)
    read: float = 0.0  # the answer has been read and split per image, here


class Timeline:
    """The stages of one request, in seconds; each stage is written by one thread at a time."""

    __slots__ = ("seconds", "_mark")

    def __init__(self, start: Optional[float] = None):
        self.seconds: dict[str, float] = {}
        self._mark = time.monotonic() if start is None else start

    def lap(self, stage: str, now: Optional[float] = None) -> float:
        """End `stage` now (it began at the last mark); return now, the next stage's start."""
        now = time.monotonic() if now is None else now
        self.add(stage, now - self._mark)
        self._mark = now
        return now

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + max(0.0, seconds)

    def add_image(self, enqueued: float, taken: float, call: Optional[CallTimes], woken: float) -> None:
        """Add one image's stages from its marks: queued, taken by a batching thread, its call, and `woken`,
        when the request's thread had the answer. The next stage starts at `woken`."""
        self.add("queue", taken - min(self._mark, enqueued))
        self._mark = woken
        if call is None or not call.read:
            self.add("batch", woken - taken)  # it never reached a model call (deadline passed, worker gone)
            return
        received = min(max(call.received, call.dispatched), call.read)
        answered = min(max(call.answered, received), call.read)
        self.add("batch", call.dispatched - taken)
        self.add("send", received - call.dispatched)
        self.add("inference", answered - received)
        self.add("return", call.read - answered)
        self.add("wake", woken - call.read)

    def ms(self) -> dict[str, float]:
        """The stages in milliseconds, in the catalogue's order."""
        return {stage: round(self.seconds[stage] * 1000, 3) for stage in STAGES if stage in self.seconds}
