"""Dynamic batching: group images from concurrent requests into model calls, behind a bounded queue.

Request threads `submit` images and wait on futures; `inference_threads` worker threads take the
oldest image, gather up to `max_batch` images of the same size (stacking needs equal shapes, so
answers stay exactly what the model gives each image alone), waiting at most `max_delay_s` from
that image's arrival for the batch to fill (as TF Serving's batch timeout and Triton's queue delay
do), and make one model call. A request that finds nothing waiting and a call free makes its call
at once in its own thread (no hand-off to a batching thread and back: on an idle virtual CPU each
wake-up costs a quarter of a millisecond). At most `threads` calls run at once either way. A full
queue refuses at once (Overloaded); an image whose deadline passed before its call is answered
DeadlineExceeded rather than run. Every submitted image gets exactly one answer, in the position it
came from. A request whose client has gone (its Cancellation, app/cancellation.py) has its images still
waiting taken out of the queue at once, each answered ClientGone, so they never reach the model; an image
already in a model call finishes there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Callable, Optional, Sequence

import numpy as np

from ..cancellation import Cancellation
from ..errors import ClientGone, DeadlineExceeded, DetectError, NotReady, Overloaded
from ..timeline import CallTimes, Timeline

log = logging.getLogger(__name__)

# Runs one model call on images of one shape, by the latest deadline among them, filling in the call's
# marks; returns one result (or error) per image.
RunBatch = Callable[[list[np.ndarray], float, CallTimes], list]


class QueuedImage(Future):
    """One submitted image: the future of its answer, and the marks of its way through the queue."""

    def __init__(self, image: np.ndarray, request: int, deadline: float):
        super().__init__()
        self.image = image
        self.request = request  # id of the submitting request
        self.deadline = deadline  # time.monotonic() after which running it is pointless
        self.enqueued = time.monotonic()
        self.taken = 0.0  # when a batching thread took it
        self.call: Optional[CallTimes] = None  # its model call's marks, once it had one

    def add_stages(self, timeline: Timeline, woken: float) -> None:
        """Add this image's queue, batch, call and wake stages to its request's timeline."""
        timeline.add_image(self.enqueued, self.taken or woken, self.call, woken)


class InferenceQueue:
    """A bounded queue of images and the worker threads that run them; thread-safe."""

    def __init__(self, run_batch: RunBatch, max_batch: int, max_delay_s: float, threads: int, max_queue: int,
                 on_wait: Optional[Callable[[float], None]] = None,
                 on_dropped: Optional[Callable[[int], None]] = None):
        self._run_batch = run_batch
        self._max_batch = max_batch
        self._max_delay_s = max_delay_s
        self._max_queue = max_queue
        self._on_wait = on_wait
        self._on_dropped = on_dropped  # called with the number of images dropped for a client that went away
        self._pending: deque[QueuedImage] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._next_request = 0
        self._threads = threads
        self._running = 0  # model calls under way, whether in a batching thread or in a request's own
        self._workers = [
            threading.Thread(target=self._work, name=f"inference-{i}", daemon=True) for i in range(threads)
        ]
        for worker in self._workers:
            worker.start()

    @property
    def max_batch(self) -> int:
        return self._max_batch

    def set_max_batch(self, max_batch: int) -> None:
        """Bound the images per call anew (a model's batch dimension is known once it is loaded)."""
        with self._cond:
            self._max_batch = max(1, max_batch)

    @property
    def depth(self) -> int:
        """Images waiting for a model call."""
        with self._cond:
            return len(self._pending)

    def refusal(self, images: int = 1) -> Optional[Overloaded]:
        """Return the Overloaded error that `images` more images would meet now, or None if they fit."""
        with self._cond:
            return self._refusal(images)

    def _refusal(self, images: int) -> Optional[Overloaded]:
        if len(self._pending) + images <= self._max_queue:
            return None
        return Overloaded(
            f"the inference queue is full ({len(self._pending)} images waiting, at most {self._max_queue}); "
            "retry shortly"
        )

    def submit(self, images: Sequence[np.ndarray], deadline: float,
               cancellation: Optional[Cancellation] = None, run_here: bool = True) -> list[QueuedImage]:
        """Queue one request's images; return their futures; raise Overloaded at once if they do not fit.

        With a `cancellation`, the images still waiting when it is cancelled are dropped (their futures
        cancelled); ClientGone if it is cancelled already. `run_here` False leaves every call to the batching
        threads: a caller that goes on submitting (a video's frames) must not be held by a call in its own
        thread, and its frames then share calls.
        """
        with self._cond:
            if self._closed:
                raise NotReady("the server is shutting down")
            if cancellation is not None and cancellation.cancelled:
                raise ClientGone("the client went away before its images were queued")
            refused = self._refusal(len(images))
            if refused is not None:
                raise refused
            self._next_request += 1
            items = [QueuedImage(image, self._next_request, deadline) for image in images]
            now_in_this_thread = run_here and self._may_run_now(items)
            if now_in_this_thread:
                self._running += 1
            else:
                self._pending.extend(items)
                self._cond.notify()
        if now_in_this_thread:
            self._run_here(items)
        elif cancellation is not None:
            forget = cancellation.on_cancel(lambda: self._drop(items))
            for item in items:
                item.add_done_callback(lambda _: forget() if all(i.done() for i in items) else None)
        return items

    def _drop(self, items: list[QueuedImage]) -> None:
        """Take the request's images still waiting out of the queue, each answered ClientGone (its client has gone)."""
        with self._cond:
            waiting = {id(item) for item in items if not item.taken}
            if not waiting:
                return
            self._pending = deque(item for item in self._pending if id(item) not in waiting)
            dropped = [item for item in items if id(item) in waiting]
        gone = ClientGone("the client went away; its image was dropped from the queue before its model call")
        for item in dropped:
            with contextlib.suppress(InvalidStateError):  # its request gave up at its deadline, and cancelled it
                item.set_exception(gone)
        log.debug("dropped %d queued image(s) of a request whose client went away", len(dropped))
        if self._on_dropped is not None:
            self._on_dropped(len(dropped))

    def _may_run_now(self, items: list[QueuedImage]) -> bool:
        """Whether a request's images make their call at once, in its own thread (under the lock).

        Only when nothing waits and a call may start (so no image is overtaken and no batch is missed),
        the images fit one call and share a shape, and no delay was asked for (max_batch_delay_ms 0): a
        lone request then crosses no thread on its way to the worker and back, as Triton's dynamic
        batcher without a queue delay sends it at once.
        """
        return (not self._pending and self._running < self._threads and self._max_delay_s <= 0
                and len(items) <= self._max_batch and all(item.image.shape == items[0].image.shape for item in items))

    def _run_here(self, items: list[QueuedImage]) -> None:
        now = time.monotonic()
        for item in items:
            item.taken = now
        try:
            self._run(items)
        finally:
            self._call_done()

    def _call_done(self) -> None:
        with self._cond:
            self._running -= 1
            if self._pending:
                self._cond.notify()  # a batching thread may take what waits

    def close(self, timeout: float = 30.0) -> None:
        """Run what is queued, then stop the workers."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join(timeout)

    def _work(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            try:
                self._run(batch)
            finally:
                self._call_done()

    def _take_batch(self) -> Optional[list[QueuedImage]]:
        """Wait for images and a free call (at most `threads` at once); take the oldest and its company."""
        with self._cond:
            while not self._pending or self._running >= self._threads:
                if self._closed and not self._pending:
                    return None
                self._cond.wait()
            self._running += 1
            first = self._pending.popleft()
            first.taken = time.monotonic()
            batch = [first]
            wait_until = first.enqueued + self._max_delay_s
            while len(batch) < self._max_batch:
                self._take_matching(batch, first.image.shape)
                if len(batch) >= self._max_batch or self._closed:
                    break
                remaining = wait_until - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return batch

    def _take_matching(self, batch: list[QueuedImage], shape) -> None:
        kept: deque[QueuedImage] = deque()
        now = time.monotonic()
        while self._pending and len(batch) < self._max_batch:
            item = self._pending.popleft()
            if item.image.shape == shape:
                item.taken = now
                batch.append(item)
            else:
                kept.append(item)
        kept.extend(self._pending)
        self._pending = kept

    def _run(self, batch: list[QueuedImage]) -> None:
        now = time.monotonic()
        live = []
        for item in batch:
            if not item.set_running_or_notify_cancel():
                continue  # its request gave up waiting
            if now > item.deadline:
                item.set_exception(DeadlineExceeded("the request deadline passed before its model call"))
                continue
            if self._on_wait is not None:
                self._on_wait(now - item.enqueued)
            live.append(item)
        if not live:
            return
        call = CallTimes()
        for item in live:
            item.call = call
        try:
            results = self._run_batch([item.image for item in live], max(item.deadline for item in live), call)
        except DetectError as exc:  # the model cannot run now (unavailable, not loaded): every image's answer
            results = [exc] * len(live)
        except Exception as exc:  # run_batch isolates per-image failures; this is a last resort
            log.exception("a model call of %d image(s) failed", len(live))
            results = [exc] * len(live)
        for item, result in zip(live, results):
            if isinstance(result, BaseException):
                item.set_exception(result)
            else:
                item.set_result(result)
