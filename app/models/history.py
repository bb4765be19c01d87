"""The memory history: the last minutes of memory per model, kept by the server for /gpu/history and the page.

The registry's supervisor thread takes one sample every SAMPLE_S: NVML's process list is read once
and /proc once per process, whatever number of clients watch. Each series is a bounded ring of
(unix time, MiB, source, state):

- one per model: what its workers hold (two, briefly, while a new version takes over; a draining
  worker until it has exited), 0 while it has none. On a host whose workers may use a GPU, that is
  NVML's used GPU memory ("nvml"); elsewhere the workers' resident host memory ("rss"), as no GPU
  cap is enforced there. The state is the model's: unloaded, loading, ready, unloading or failed.
- one per worker group ("group"), in place of its members': what its one worker holds, and which of
  its members are loaded (the members share it; it is not split between them);
- "server": the HTTP process's resident host memory (it never holds GPU memory: no TensorFlow);
- "spares": the spare workers' resident memory (TensorFlow imported, no model, no GPU memory).

A page opened later still shows the last KEEP_S seconds.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Optional

from .workers import rss_mib

SAMPLE_S = 1.0  # one sample a second: a load (about a second) shows as a step
KEEP_S = 600.0  # ten minutes per series: 600 samples of a few dozen bytes each
SERVER, SPARES = "server", "spares"  # the series that are not models; model names cannot clash (kinds differ)


class MemoryHistory:
    """Bounded rings of memory samples, one per series; thread-safe (the supervisor writes, requests read)."""

    def __init__(self, interval_s: float = SAMPLE_S, keep_s: float = KEEP_S):
        self.interval_s = interval_s
        self.keep_s = keep_s
        self._size = max(1, int(round(keep_s / interval_s)))
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], deque] = {}  # (kind, name) -> samples, oldest first
        self._next = 0.0  # monotonic time of the next sample

    def due(self, now: float) -> bool:
        """Return whether a sample is due at monotonic time `now`, and if so count it as taken."""
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True

    def record(self, unix: float, rows: list[tuple[str, str, Optional[float], str, str]]) -> None:
        """Append one sample per (kind, name, used MiB, source, state) row, all at `unix`."""
        with self._lock:
            for kind, name, used, source, state in rows:
                ring = self._series.get((kind, name))
                if ring is None:
                    ring = self._series[(kind, name)] = deque(maxlen=self._size)
                ring.append((round(unix, 3), None if used is None else round(used, 1), source, state))

    def to_json(self, since: Optional[float] = None) -> dict:
        """Describe the series for /gpu/history; with `since`, only the samples taken after it."""
        with self._lock:
            series = [(kind, name, [list(s) for s in ring if since is None or s[0] > since])
                      for (kind, name), ring in self._series.items()]
        order = {"model": 0, "group": 1, SERVER: 2, SPARES: 3}
        series.sort(key=lambda item: (order.get(item[0], 3), item[1]))
        return {
            "interval_s": self.interval_s,
            "keep_s": self.keep_s,
            "now_unix": round(time.time(), 3),
            "fields": ["unix", "used_mib", "source", "state"],
            "series": [{"kind": kind, "name": name, "samples": samples} for kind, name, samples in series],
        }


def sample_memory(registry) -> list[tuple[str, str, Optional[float], str, str]]:
    """Read what each model's workers, the spares and the HTTP process hold now (NVML once, /proc per process).

    Called by the registry's supervisor thread, outside the registry's lock but for a quick look.
    """
    with registry.lock:
        states = {name: model.state for name, model in registry.models.items()}
        grouped = {name: m.settings.worker_group for name, m in registry.models.items() if m.settings.worker_group}
    grouped_members: dict[str, list[str]] = {}
    for name, group in sorted(grouped.items()):
        grouped_members.setdefault(group, []).append(name)
    spares = {w.pid for w in registry.pool.spares()}
    by_model: dict[str, list] = {name: [] for name in states}
    spare_workers = []
    by_group: dict[str, list] = {}
    for worker in registry.pool.workers():
        if worker.exit_code is not None:
            continue
        if worker.pid in spares:
            spare_workers.append(worker)
        elif worker.group:
            by_group.setdefault(worker.group, []).append(worker)
        elif worker.model is not None and worker.model.name in by_model:
            by_model[worker.model.name].append(worker)
    on_gpu = registry.nvml is not None and bool(registry.gpus)
    gpu_used = registry.gpu_processes() if on_gpu else {}

    def held(workers: list) -> float:
        if on_gpu:
            return float(sum(sum(gpu_used.get(w.pid, {}).values()) for w in workers))
        return float(sum(rss_mib(w.pid) or 0.0 for w in workers))

    rows = []
    for name, workers in sorted(by_model.items()):
        if name not in grouped:
            rows.append(("model", name, held(workers), "nvml" if on_gpu else "rss", states[name]))
    for group, members in sorted(grouped_members.items()):
        loaded = [n for n in members if states[n] in ("ready", "unloading")]
        rows.append(("group", group, held(by_group.get(group, [])), "nvml" if on_gpu else "rss",
                     f"{', '.join(loaded) or 'none'} loaded"))
    rows.append((SERVER, SERVER, rss_mib(os.getpid()), "rss", "running"))
    rows.append((SPARES, SPARES, float(sum(rss_mib(w.pid) or 0.0 for w in spare_workers)), "rss",
                 f"{len(spare_workers)} spare" + ("" if len(spare_workers) == 1 else "s")))
    return rows
