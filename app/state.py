"""Whether this instance can take requests: loading, ready, or draining for shutdown."""

from __future__ import annotations

import threading
from typing import Optional

from .detector import Detector


class ServingState:
    """Set from the I/O thread and the loader thread, read from WSGI threads; thread-safe."""

    def __init__(self, detector: Optional[Detector] = None):
        self._lock = threading.Lock()
        self._detector = detector
        self._draining = False

    def set_detector(self, detector: Detector) -> None:
        """Publish the loaded, warmed detector; from now on the instance is ready."""
        with self._lock:
            self._detector = detector

    def start_draining(self) -> None:
        """Report not ready from now on (shutdown has begun); requests already accepted still finish."""
        with self._lock:
            self._draining = True

    @property
    def detector(self) -> Optional[Detector]:
        """The detector once loaded; it stays usable while draining so accepted requests finish."""
        with self._lock:
            return self._detector

    @property
    def draining(self) -> bool:
        with self._lock:
            return self._draining

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._detector is not None and not self._draining
