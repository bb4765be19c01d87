"""One load step against a running server: loadgen in a process of its own, the server's figures around it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from tools import loadgen
from tools.samplers import StatsSampler, load_average
from tools.server import ServerProcess


def drive(server: ServerProcess, images: Path, out: Path, label: str, connections: int, duration_s: float,
          requests: Optional[int] = None, rate: Optional[float] = None, timeout_s: float = 60.0,
          records: bool = False, arrivals: str = "uniform", v2_model: Optional[str] = None,
          grpc_model: Optional[str] = None) -> dict:
    """Run one load step against the server in a separate process; add server and machine figures.

    With `v2_model`, the images go to /v2/models/<v2_model>/infer as binary BYTES inputs; with `grpc_model`,
    to the gRPC port as KServe v2 ModelInfer calls."""
    load_before = load_average()
    before = server.stats()
    started = time.monotonic()
    with StatsSampler(server) as sampler:
        process = loadgen.spawn(server.grpc_port if grpc_model else server.port, images, out, connections,
                                duration_s, requests=requests, rate=rate, timeout_s=timeout_s, records=records,
                                label=label, arrivals=arrivals, v2_model=v2_model, grpc_model=grpc_model)
        budget = (duration_s if requests is None else max(duration_s, 3600.0)) + timeout_s + 30
        result = loadgen.collect(process, out, budget)
    wall = time.monotonic() - started
    after = server.stats()
    result["server"] = {
        "before": before, "after": after,
        "rss_mb_peak": max([s["rss_mb"] for s in sampler.samples] + [after["rss_mb"]]),
        "cpu_percent": round(100 * (after["cpu_s"] - before["cpu_s"]) / wall, 1) if wall > 0 else None,
    }
    result["load_average"] = {"before": load_before, "after": load_average()}
    result["samples"] = sampler.samples
    return result


def overall_statuses(result: dict) -> tuple[int, int, int]:
    """Return (200s, 503s, other statuses) of a load step."""
    statuses = {int(k): v for k, v in result["statuses"].items()}
    ok, busy = statuses.get(200, 0), statuses.get(503, 0)
    return ok, busy, sum(statuses.values()) - ok - busy
