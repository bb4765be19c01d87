"""Measure a model's life in its worker: cold starts, serving, idle unload, and the memory through all of it.

Starts `python -m app serve` on the shipped repository with preload off and a short idle_unload_s,
then for each model, `--rounds` times: waits until the model is unloaded and the spare worker is
ready, sends one request and times it from the request to the answer (the cold start), serves
`--serve-s` seconds of requests, and waits for the idle unload. Meanwhile it samples the resident
memory of the HTTP process, of each worker and of the spare from /proc every 0.1 s.

Writes lifecycle.json (every cold start, and the memory after each unload) and lifecycle.png (memory
over time, by process) to the output folder. Exit status 0, or 2 if the server could not run.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from tools import ROOT
from tools.images import make_images
from tools.server import ServerProcess, write_settings


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


class MemorySampler:
    """Sample every server process's RSS from /proc, labelled by what it is, in a background thread."""

    def __init__(self, server: ServerProcess, every_s: float = 0.1):
        self.server = server
        self.every_s = every_s
        self.samples: list[dict] = []
        self.events: list[tuple[float, str]] = []
        self.t0 = time.monotonic()
        self._roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def mark(self, what: str) -> None:
        self.events.append((round(time.monotonic() - self.t0, 2), what))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def roles(self) -> dict[int, str]:
        """Map pids to 'http', a model's name, or 'spare', from /models."""
        _, listing = request(self.server.port, "GET", "/models")
        roles = {self.server.pid: "http"}
        roles.update({m["pid"]: f"worker: {m['name']}" for m in listing["models"] if m["pid"]})
        roles.update({s["pid"]: "spare" for s in listing.get("spares", [])})
        return roles

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._roles.update(self.roles())
            except OSError:
                return
            now = round(time.monotonic() - self.t0, 2)
            for pid in self.server.pids():
                stats = self.server._process_stats(pid)
                if stats is not None:
                    self.samples.append({"t": now, "pid": pid, "role": self._roles.get(pid, "worker"),
                                         "rss_mb": stats["rss_mb"]})
            self._stop.wait(self.every_s)


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def listing(port: int) -> dict:
    return request(port, "GET", "/models")[1]


def unloaded_with_a_ready_spare(port: int, model: str) -> bool:
    found = listing(port)
    state = {m["name"]: m["state"] for m in found["models"]}
    return state[model] == "unloaded" and any(s["ready"] for s in found.get("spares", []))


def run(args) -> dict:
    out = args.out.resolve()
    images = make_images(out / "images", count=4)
    body = sorted(images.glob("*.jpg"))[0].read_bytes()
    config = out / "server.toml"
    write_settings(config, {"model_repository": str(ROOT / "models"), "default_model": "faces",
                                  "preload": False, "idle_unload_s": args.idle_s, "spare_workers": 1,
                                  "log_level": "INFO"})
    server = ServerProcess.start(config, out / "server.log")
    result = {"idle_unload_s": args.idle_s, "rounds": args.rounds, "models": {}}
    try:
        with MemorySampler(server) as sampler:
            http_alone = []
            for model in args.models:
                starts = []
                for round_ in range(args.rounds):
                    wait_for(lambda: unloaded_with_a_ready_spare(server.port, model), 120, f"{model} unloaded, spare ready")
                    settled = server.stats()
                    http_alone.append({"model": model, "http_rss_mb": settled["http"]["rss_mb"],
                                       "all_rss_mb": settled["rss_mb"], "processes": settled["processes"]})
                    sampler.mark(f"{model}: request (cold)")
                    sent = time.monotonic()
                    status, answer = request(server.port, "POST", f"/models/{model}/detect", body,
                                             {"Content-Type": "image/jpeg"})
                    seconds = time.monotonic() - sent
                    if status != 200:
                        raise RuntimeError(f"{model}: status {status}: {answer}")
                    starts.append({"seconds": round(seconds, 3), "timing_ms": answer["timing_ms"]})
                    print(f"{model} round {round_ + 1}: cold start {seconds * 1000:.0f} ms "
                          f"(load {answer['timing_ms'].get('load', 0):.0f} ms)", file=sys.stderr, flush=True)
                    sampler.mark(f"{model}: serving")
                    until = time.monotonic() + args.serve_s
                    while time.monotonic() < until:
                        request(server.port, "POST", f"/models/{model}/detect", body, {"Content-Type": "image/jpeg"})
                    sampler.mark(f"{model}: idle")
                    wait_for(lambda: unloaded_with_a_ready_spare(server.port, model), 120, f"{model} unloaded")
                    sampler.mark(f"{model}: unloaded")
                seconds = [s["seconds"] for s in starts]
                result["models"][model] = {"cold_starts": starts, "median_s": round(statistics.median(seconds), 3),
                                           "max_s": max(seconds)}
            time.sleep(1.0)
            settled = server.stats()
            http_alone.append({"model": None, "http_rss_mb": settled["http"]["rss_mb"], "all_rss_mb": settled["rss_mb"],
                               "processes": settled["processes"]})
        result["memory_when_unloaded"] = http_alone
        result["samples"] = sampler.samples
        result["events"] = sampler.events
    finally:
        server.stop()
    return result


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(11, 4.5))
    by_process: dict[tuple[int, str], list] = {}
    for s in result["samples"]:
        by_process.setdefault((s["pid"], s["role"]), []).append((s["t"], s["rss_mb"]))
    colours = {"http": "black", "spare": "grey"}
    labelled = set()
    for (pid, role), points in sorted(by_process.items(), key=lambda item: item[1][0][0]):
        ts, rss = zip(*points)
        label = role if role not in labelled else None
        labelled.add(role)
        colour = colours.get(role, "tab:orange" if "shapes" in role else "tab:blue")
        ax.plot(ts, rss, color=colour, label=label, linewidth=1.4, linestyle=":" if role == "spare" else "-")
    for t, what in result["events"]:
        if what.endswith("(cold)") or what.endswith("unloaded"):
            ax.axvline(t, color="red" if what.endswith("(cold)") else "green", alpha=0.3, linewidth=0.8)
    ax.set_xlabel("seconds (red: a request for an unloaded model; green: its worker has exited)")
    ax.set_ylabel("resident memory, MB")
    ax.set_title(f"Each process's memory through cold start, serving, idle ({result['idle_unload_s']:g} s) and "
                 "unload (no GPU: resident memory)", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    path.write_bytes(buffer.getvalue())
    plt.close(fig)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/lifecycle", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "lifecycle")
    parser.add_argument("--models", default="shapes,faces", help="comma-separated models of the shipped repository")
    parser.add_argument("--rounds", type=int, default=5, help="cold starts per model (5)")
    parser.add_argument("--serve-s", type=float, default=3.0, help="seconds of requests after each cold start (3)")
    parser.add_argument("--idle-s", type=float, default=3.0, help="idle_unload_s for the run (3)")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args)
    except (RuntimeError, OSError) as exc:
        print(f"lifecycle: error: {exc}", file=sys.stderr)
        return 2
    (args.out / "lifecycle.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "lifecycle.png")
    for model, figures in result["models"].items():
        print(f"{model}: cold start median {figures['median_s'] * 1000:.0f} ms, worst {figures['max_s'] * 1000:.0f} ms "
              f"over {len(figures['cold_starts'])}")
    for row in result["memory_when_unloaded"]:
        print(f"unloaded ({row['model'] or 'end'}): HTTP process {row['http_rss_mb']} MB, all {row['processes']} "
              f"processes {row['all_rss_mb']} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
