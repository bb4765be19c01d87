"""The detector as the HTTP layer sees it when serving: images in, detections out, through the batcher."""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional, Sequence

import numpy as np

from .batcher import InferenceQueue
from .detector import Detection, Detector, to_detections
from .errors import DeadlineExceeded


class BatchingDetector:
    """Route every image through one InferenceQueue; `detect` is called from many WSGI threads."""

    def __init__(self, detector: Detector, queue: InferenceQueue, deadline_s: float):
        self._detector = detector
        self.queue = queue
        self._deadline_s = deadline_s

    @property
    def name(self) -> str:
        return self._detector.name

    @property
    def version(self) -> str:
        return self._detector.version

    def detect(self, images: Sequence[np.ndarray], threshold: float, max_detections: int,
               deadline: Optional[float] = None) -> list[list[Detection]]:
        """Queue the images, wait for their answers, and turn them into detections; raise per-image errors."""
        deadline = deadline if deadline is not None else time.monotonic() + self._deadline_s
        futures = self.queue.submit(images, deadline)
        outputs = []
        for future in futures:
            try:
                outputs.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                for pending in futures:
                    pending.cancel()
                raise DeadlineExceeded(
                    f"no answer within the request deadline of {self._deadline_s:g} s; the server is busy"
                ) from None
        labels = self._detector.labels
        return [
            to_detections(out, image.shape[1], image.shape[0], labels, threshold, max_detections)
            for image, out in zip(images, outputs)
        ]


def batching_detector(detector: Detector, max_batch_size: int, max_batch_delay_ms: float, inference_threads: int,
                      max_queue: int, deadline_s: float, on_wait=None) -> BatchingDetector:
    """Wrap a loaded detector in a queue sized by the settings and by the model's batch dimension."""
    max_batch = min(max_batch_size, detector.max_batch or max_batch_size)
    queue = InferenceQueue(detector.run_batch, max_batch=max_batch, max_delay_s=max_batch_delay_ms / 1000.0,
                           threads=inference_threads, max_queue=max_queue, on_wait=on_wait)
    return BatchingDetector(detector, queue, deadline_s)
