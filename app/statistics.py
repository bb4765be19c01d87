"""Each model's inference statistics, in the terms of Triton's statistics extension.

Triton's clients read these to split a request's time in the server: perf_analyzer's report prints them as
"Server: queue, compute input, compute infer, compute output". They come from the stages every inference
request already records (app/timeline.py) and from each model call:

| Triton's name    | this server's stages                                        |
|------------------|-------------------------------------------------------------|
| queue            | load (waiting for the model to load), queue, batch           |
| compute_input    | decode, send (stacking the batch into the worker's lane)     |
| compute_infer    | inference (the model call, as the worker timed it)           |
| compute_output   | return, wake, encode                                         |
| success          | the sum of those four, for a request answered                |
| fail             | the time of a request that reached its model and failed      |

`inference_count` counts images and `execution_count` model calls, so their ratio is the batching gain;
`batch_stats` gives each batch size's calls and their compute_infer time. The counts live in the HTTP
process, per model name, from the server's start: they go on across a worker restart and a version swap
(a model's statistics are its own, whichever version or worker served it). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

# Triton's stage names, and which of this server's stages (app/timeline.py's STAGES) make each.
TRITON_STAGES = {
    "queue": ("load", "queue", "batch"),
    "compute_input": ("decode", "send"),
    "compute_infer": ("inference",),
    "compute_output": ("return", "wake", "encode"),
}
DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)

    def to_json(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass
class _ModelCounts:
    last_inference_ms: int = 0  # unix time of the last request answered, in milliseconds
    inference_count: int = 0
    execution_count: int = 0
    durations: dict = field(default_factory=lambda: {name: _Duration() for name in DURATIONS})
    batches: dict = field(default_factory=dict)  # batch size -> its calls' compute_infer _Duration


class InferenceStatistics:
    """The counts of every model, written by request threads and batching threads, read by the statistics routes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._models: dict[str, _ModelCounts] = {}

    def observe_request(self, model: str, images: int, stages: dict[str, float], answered: bool) -> None:
        """Record one inference request that reached `model`: its images, its stages (seconds), answered or failed."""
        with self._lock:
            counts = self._models.setdefault(model, _ModelCounts())
            parts = {name: sum(stages.get(stage, 0.0) for stage in ours) for name, ours in TRITON_STAGES.items()}
            total = sum(parts.values())
            if not answered:
                counts.durations["fail"].add(total)
                return
            counts.durations["success"].add(total)
            for name, seconds in parts.items():
                counts.durations[name].add(seconds)
            counts.inference_count += images
            counts.last_inference_ms = int(time.time() * 1000)

    def observe_execution(self, model: str, images: int, seconds: float) -> None:
        """Record one model call of `images` images that took `seconds` in the worker."""
        with self._lock:
            counts = self._models.setdefault(model, _ModelCounts())
            counts.execution_count += 1
            counts.batches.setdefault(images, _Duration()).add(seconds)

    def model_stats(self, name: str, version: str) -> dict:
        """One model's statistics in Triton's JSON form (zeros for a model that has run nothing yet)."""
        with self._lock:
            counts = self._models.get(name) or _ModelCounts()
            return {
                "name": name, "version": version, "last_inference": counts.last_inference_ms,
                "inference_count": counts.inference_count, "execution_count": counts.execution_count,
                "inference_stats": {key: counts.durations[key].to_json() for key in DURATIONS},
                "batch_stats": [{"batch_size": size, "compute_infer": duration.to_json()}
                                for size, duration in sorted(counts.batches.items())],
                "memory_usage": [],
            }
