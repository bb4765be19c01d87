"""Dynamic batching: group images from concurrent requests into model calls, behind a bounded queue.

Request threads `submit` images and wait on futures; `inference_threads` worker threads take the
oldest image, gather up to `max_batch` images of the same size (stacking needs equal shapes, so
answers stay exactly what the model gives each image alone), waiting at most `max_delay_s` from
that image's arrival for the batch to fill (as TF Serving's batch timeout and Triton's queue delay
do), and make one model call. A full queue refuses
at once (Overloaded); an image whose deadline passed before its call is answered DeadlineExceeded
rather than run. Every submitted image gets exactly one answer, in the position it came from.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import DeadlineExceeded, DetectError, NotReady, Overloaded

log = logging.getLogger(__name__)

# Runs one model call on images of one shape, by the latest deadline among them; returns one result (or
# error) per image.
RunBatch = Callable[[list[np.ndarray], float], list]


@dataclass
class _Item:
    image: np.ndarray
    request: int  # id of the submitting request
    deadline: float  # time.monotonic() after which running it is pointless
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)


class InferenceQueue:
    """A bounded queue of images and the worker threads that run them; thread-safe."""

    def __init__(self, run_batch: RunBatch, max_batch: int, max_delay_s: float, threads: int, max_queue: int,
                 on_wait: Optional[Callable[[float], None]] = None):
        self._run_batch = run_batch
        self._max_batch = max_batch
        self._max_delay_s = max_delay_s
        self._max_queue = max_queue
        self._on_wait = on_wait
        self._pending: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._next_request = 0
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

    def submit(self, images: Sequence[np.ndarray], deadline: float) -> list[Future]:
        """Queue one request's images; raise Overloaded at once if they do not fit."""
        with self._cond:
            if self._closed:
                raise NotReady("the server is shutting down")
            refused = self._refusal(len(images))
            if refused is not None:
                raise refused
            self._next_request += 1
            items = [_Item(image=image, request=self._next_request, deadline=deadline) for image in images]
            self._pending.extend(items)
            self._cond.notify_all()
        return [item.future for item in items]

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
            self._run(batch)

    def _take_batch(self) -> Optional[list[_Item]]:
        with self._cond:
            while not self._pending:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._pending.popleft()
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

    def _take_matching(self, batch: list[_Item], shape) -> None:
        kept: deque[_Item] = deque()
        while self._pending and len(batch) < self._max_batch:
            item = self._pending.popleft()
            (batch if item.image.shape == shape else kept).append(item)
        kept.extend(self._pending)
        self._pending = kept

    def _run(self, batch: list[_Item]) -> None:
        now = time.monotonic()
        live = []
        for item in batch:
            if not item.future.set_running_or_notify_cancel():
                continue  # its request gave up waiting
            if now > item.deadline:
                item.future.set_exception(DeadlineExceeded("the request deadline passed before its model call"))
                continue
            if self._on_wait is not None:
                self._on_wait(now - item.enqueued)
            live.append(item)
        if not live:
            return
        try:
            results = self._run_batch([item.image for item in live], max(item.deadline for item in live))
        except DetectError as exc:  # the model cannot run now (unavailable, not loaded): every image's answer
            results = [exc] * len(live)
        except Exception as exc:  # run_batch isolates per-image failures; this is a last resort
            log.exception("a model call of %d image(s) failed", len(live))
            results = [exc] * len(live)
        for item, result in zip(live, results):
            if isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)
