"""Worker groups measured (issue 43): memory at rest, density per model, and mixed traffic, grouped against separate.

Three runs, each a real `python -m app serve` child (tools/server.py) with its settings in a file:

- `rest`: the three shipped models, all preloaded, each in a worker of its own against all in one group,
  with one spare worker and with none: the server's process tree's RSS and PSS (benchmarks/peers/proctree.py)
  5 s after ready.
- `density`: N copies of the shapes model under different names (N = 1, 4, 16 by default), one worker each
  against one group, no spare: host memory per model (the tree's RSS and PSS over N) and the GPU memory the
  budget plans per model (each worker's cap plus one gpu_overhead_mib, against the group's cap, N members'
  caps, plus one overhead), with a figure (`--plot`).
- `mixed`: objects and shapes under 64 connections (32 each, tools/loadgen.py in processes of their own),
  in one group against a worker each, in turns (separate, grouped, grouped, separate).

Run as `python -m tools.density rest|density|mixed [--out FILE] [--plot PNG]`; JSON on stdout or `--out`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmarks.peers.proctree import sample
from tools import ROOT
from tools.loadgen import collect, spawn
from tools.server import ServerProcess

SHIPPED = ("objects", "faces", "shapes")
CAP_MIB = 2048  # shapes' cap in config/default.toml
OVERHEAD_MIB = 1024  # gpu_overhead_mib's default


def _config(folder: Path, name: str, repository: Path, models: list[str], grouped: bool, spares: int,
            default_model: Optional[str] = None, group_cap: str = "4GiB") -> Path:
    """Write a settings file: the repository, preload, spares, and every model in group `all` where `grouped`."""
    lines = [f'model_repository = "{repository}"', "preload = true", f"spare_workers = {spares}",
             "idle_unload_s = 0.0", "model_poll_s = 0.0", 'grpc_port = "off"', 'precision = "fp32"',
             f'default_model = "{default_model or models[0]}"']
    for model in models:
        lines += [f"[models.{model}]", f'worker_group = "{"all" if grouped else ""}"']
    if grouped:
        lines += ["[groups.all]", f'gpu_memory = "{group_cap}"']
    path = folder / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _at_rest(config: Path, log: Path, settle_s: float = 5.0) -> dict:
    server = ServerProcess.start(config, log)
    try:
        time.sleep(settle_s)
        return sample(server.pid)
    finally:
        server.stop()


def rest(folder: Path) -> list[dict]:
    """The shipped models at rest, separate and grouped, with a spare and without."""
    rows = []
    for grouped in (False, True):
        for spares in (1, 0):
            name = f"{'grouped' if grouped else 'separate'}-{spares}-spare"
            config = _config(folder, name, ROOT / "models", list(SHIPPED), grouped, spares, "objects")
            rows.append({"layout": "one group" if grouped else "a worker each", "spares": spares,
                         **_at_rest(config, folder / f"{name}.log")})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def density(folder: Path, counts: list[int]) -> list[dict]:
    """N copies of shapes, a worker each against one group: host memory and planned GPU memory per model."""
    rows = []
    for n in counts:
        repository = folder / f"repo-{n}"
        names = [f"shapes{i:02d}" for i in range(n)]
        for name in names:
            if not (repository / name).exists():
                shutil.copytree(ROOT / "models" / "shapes" / "1", repository / name / "1")
        for grouped in (False, True):
            label = f"{'grouped' if grouped else 'separate'}-{n}"
            config = _config(folder, label, repository, names, grouped, 0, group_cap=f"{CAP_MIB * n}MiB")
            found = _at_rest(config, folder / f"{label}.log")
            planned = CAP_MIB + (OVERHEAD_MIB / n if grouped else OVERHEAD_MIB)
            rows.append({"n": n, "layout": "one group" if grouped else "a worker each", **found,
                         "rss_per_model_mib": round(found["rss_mib"] / n, 1),
                         "pss_per_model_mib": round(found["pss_mib"] / n, 1),
                         "planned_gpu_per_model_mib": round(planned, 1)})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def mixed(folder: Path, duration_s: float, connections: int) -> list[dict]:
    """Objects and shapes under `connections` connections, grouped against separate, in turns."""
    images = folder / "images"
    images.mkdir(exist_ok=True)
    shutil.copy(ROOT / "samples" / "scene.jpg", images / "scene.jpg")
    rows = []
    for grouped in (False, True, True, False):
        label = "grouped" if grouped else "separate"
        config = _config(folder, f"mixed-{label}", ROOT / "models", ["objects", "shapes"], grouped, 0)
        server = ServerProcess.start(config, folder / f"mixed-{label}.log")
        try:
            loads = [spawn(server.port, images, folder / f"{label}-{model}.json", connections // 2, duration_s,
                           path=f"/models/{model}/detect") for model in ("objects", "shapes")]
            before = server.stats()["cpu_s"]
            results = [collect(p, folder / f"{label}-{m}.json", duration_s + 120)
                       for p, m in zip(loads, ("objects", "shapes"))]
            cpu_s = server.stats()["cpu_s"] - before
        finally:
            server.stop()
        row = {"layout": label, "connections": connections, "duration_s": duration_s,
               "ok_per_s": {m: r["ok_per_s"] for m, r in zip(("objects", "shapes"), results)},
               "failed": sum(sum(n for s, n in r["statuses"].items() if s != "200") for r in results),
               "p50_ms": {m: r["latency_ms"]["p50"] for m, r in zip(("objects", "shapes"), results)},
               "server_cpu_s": round(cpu_s, 1)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (host, gpu) = plt.subplots(1, 2, figsize=(9, 3.6))
    for layout, marker, colour in (("a worker each", "o", "C0"), ("one group", "s", "C1")):
        mine = [r for r in rows if r["layout"] == layout]
        ns = [r["n"] for r in mine]
        host.plot(ns, [r["pss_per_model_mib"] for r in mine], marker=marker, color=colour, label=f"{layout} (PSS)")
        host.plot(ns, [r["rss_per_model_mib"] for r in mine], marker=marker, color=colour, linestyle=":",
                  label=f"{layout} (RSS)")
        gpu.plot(ns, [r["planned_gpu_per_model_mib"] for r in mine], marker=marker, color=colour, label=layout)
    for axis, title in ((host, "host memory per model (MiB)"), (gpu, "planned GPU memory per model (MiB)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks([r["n"] for r in rows if r["layout"] == "one group"])
        axis.set_xticklabels([str(r["n"]) for r in rows if r["layout"] == "one group"])
        axis.set_xlabel("copies of shapes (N)")
        axis.set_title(title, fontsize=10)
        axis.set_ylim(bottom=0)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.density", description=__doc__.splitlines()[0])
    parser.add_argument("run", choices=("rest", "density", "mixed"))
    parser.add_argument("--counts", default="1,4,16", help="density: the N to measure (1,4,16)")
    parser.add_argument("--duration", type=float, default=30.0, help="mixed: seconds per turn (30)")
    parser.add_argument("--connections", type=int, default=64, help="mixed: connections, half per model (64)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="density: the figure (PNG)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="density-") as temporary:
        folder = Path(temporary)
        if args.run == "rest":
            rows = rest(folder)
        elif args.run == "density":
            rows = density(folder, [int(n) for n in args.counts.split(",")])
            if args.plot:
                plot(rows, args.plot)
        else:
            rows = mixed(folder, args.duration, args.connections)
    text = json.dumps(rows, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
