"""Measure what a spare worker costs and what it buys: resident memory against cold-start time.

For each model and each `spare_workers` count, start this service on a repository holding only that
model, not preloaded (`preload = false`, `idle_unload_s = 0`), and, each from /proc over the whole
process tree (benchmarks/peers/proctree.py, RSS and PSS):

- at rest before any load: the HTTP process and its spares (resident pages counted once, and RSS summed);
- the cold load: from POST /v2/repository/models/<name>/load to the first answer of POST /models/<name>/detect;
- loaded, after 20 requests and once the spares are back: the tree's memory;
- the crash: from `kill -9` of the model's worker to its first answer again (`restart_backoff_s = 0`, so the
  figure is the restart itself; the default adds a 1 s delay before the first restart).

    .venv/bin/python -m benchmarks.spare [--models shapes,objects] [--spares 0,1,2] [--out out/spare]

Writes spare.json and spare.md; every row carries the load average taken with it (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.peers import proctree
from benchmarks.peers.systems import free_port, spares_ready
from tools import ROOT
from tools.images import make_images
from tools.samplers import load_average

TIMEOUT_S = 300.0


def get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
        return json.loads(answer.read())


def post(port: int, path: str, body: bytes, content_type: str, timeout_s: float = 60.0) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                     headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        answer.read()
        return answer.status


def until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def answers(port: int, name: str, jpeg: bytes) -> bool:
    try:
        return post(port, f"/models/{name}/detect", jpeg, "image/jpeg", timeout_s=30) == 200
    except (OSError, urllib.error.URLError):
        return False


def healthy(port: int) -> bool:
    try:
        get(port, "/healthz")
        return True
    except (OSError, ValueError):
        return False


def measure(service_root: Path, model: Path, spares: int, jpeg: bytes, work: Path) -> dict:
    """Start the service with `spares` spare workers on this model alone; return its memory and cold starts."""
    name = model.name
    repository = work / f"repo-{name}"
    repository.mkdir(parents=True, exist_ok=True)
    if not (repository / name).exists():
        (repository / name).symlink_to(model)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DETECT_", "PYTHONPATH"))}
    env.update(DETECT_PORT=str(port), DETECT_GRPC_PORT="off", DETECT_MODEL_REPOSITORY=str(repository),
               DETECT_PRELOAD="false", DETECT_IDLE_UNLOAD_S="0", DETECT_SPARE_WORKERS=str(spares),
               DETECT_RESTART_BACKOFF_S="0", DETECT_MODEL_POLL_S="0", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=str(service_root))
    log = work / f"{name}-{spares}.log"
    with log.open("wb") as handle:
        process = subprocess.Popen([sys.executable, "-m", "app", "serve"], cwd=service_root, env=env, stdout=handle,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    row = {"model": name, "spare_workers": spares, "load_average_start": load_average()}
    seen: dict[int, int] = {}  # every process of its tree (pid: start time)
    try:
        until(lambda: process.poll() is None and healthy(port), "the HTTP process")
        until(lambda: spares_ready(port, spares), "the spare workers")
        time.sleep(1.0)
        row["at_rest"] = proctree.sample(process.pid, unique=True)
        started = time.monotonic()
        post(port, f"/v2/repository/models/{name}/load", b"{}", "application/json", timeout_s=TIMEOUT_S)
        until(lambda: answers(port, name, jpeg), "the first answer")
        row["cold_load_s"] = round(time.monotonic() - started, 2)
        for _ in range(20):
            answers(port, name, jpeg)
        until(lambda: spares_ready(port, spares), "the spare workers after the load")
        time.sleep(1.0)
        row["loaded"] = proctree.sample(process.pid, unique=True)
        seen.update(proctree.identities(proctree.tree(process.pid)))
        worker = next(m["pid"] for m in get(port, "/models")["models"] if m["name"] == name)
        started = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        until(lambda: answers(port, name, jpeg), "the answer after the crash")
        row["crash_restart_s"] = round(time.monotonic() - started, 2)
        row["load_average_end"] = load_average()
    except (RuntimeError, OSError, ValueError, StopIteration) as exc:
        row["error"] = f"{type(exc).__name__}: {exc} (log: {log})"
    finally:
        row["stop"] = proctree.stop_started(process, seen)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | spare_workers | at rest, no model: MiB resident (RSS summed), processes | loaded: "
             "MiB resident (RSS summed), processes | cold load to first answer (s) | kill -9 to answer (s) "
             "| load average (1 min) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['model']} | {row['spare_workers']} | failed: {row['error']} | | | | |")
            continue
        rest, loaded = row["at_rest"], row["loaded"]
        lines.append(f"| {row['model']} | {row['spare_workers']} | {rest['unique_mib']} ({rest['rss_mib']:.0f}), "
                     f"{rest['processes']} | {loaded['unique_mib']} ({loaded['rss_mib']:.0f}), {loaded['processes']} "
                     f"| {row['cold_load_s']} | {row['crash_restart_s']} | {row['load_average_start'][0]} to "
                     f"{row['load_average_end'][0]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spare", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="shapes,objects", help="names under models/")
    parser.add_argument("--spares", default="0,1,2", help="spare_workers counts")
    parser.add_argument("--service-root", type=Path, default=ROOT, help="the checkout to run (default: this one)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "spare")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    jpeg = sorted(make_images(args.out / "images", count=1).glob("*.jpg"))[0].read_bytes()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            for spares in (int(n) for n in args.spares.split(",")):
                row = measure(args.service_root.resolve(), (ROOT / "models" / name).resolve(), spares, jpeg,
                              Path(scratch))
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "stop"}), file=sys.stderr, flush=True)
                if row["stop"]["left"]:
                    print(f"left behind: {row['stop']['left']}", file=sys.stderr)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(), "rows": rows,
              "command": "benchmarks/spare.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    (args.out / "spare.json").write_text(json.dumps(result, indent=1))
    (args.out / "spare.md").write_text(table(rows))
    print(table(rows))
    return 1 if any(r.get("error") or r["stop"]["left"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
