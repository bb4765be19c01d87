"""Machine and server figures taken while load runs: the load average, a server's /proc figures over time."""

from __future__ import annotations

import os
import threading
import time

from tools.server import ServerProcess


def load_average() -> list[float]:
    """Return the 1, 5 and 15 minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


class StatsSampler:
    """Sample a server's /proc figures every `every_s` in a background thread."""

    def __init__(self, server: ServerProcess, every_s: float = 0.5):
        self.samples: list[dict] = []
        self._server = server
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stats-sampler", daemon=True)

    def __enter__(self) -> "StatsSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            try:
                self.samples.append({"t": round(time.monotonic() - t0, 2), **self._server.stats()})
            except (OSError, AttributeError):
                return  # the server is gone
            self._stop.wait(self._every_s)
