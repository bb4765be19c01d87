"""Chaos soak: the whole server under mixed traffic on every protocol while faults land on a seeded schedule.

Starts `python -m app serve` on a copy of the shipped repository (shapes, objects and faces; a GPU budget that
holds two of the three workers, so loads evict; short idle unloads; frequent version polls), then:

1. warm-up (a tenth of the time, at least 15 s): the reference answers of every scene (tools/chaos/traffic.py),
   then traffic from `--clients` processes and one burst, so that the thread pools reach their size;
   the last sample of the warm-up is the baseline the leak checks compare with;
2. chaos (seven tenths): traffic on, and every `--fault-every-s` one fault drawn from FAULTS with the seed:
   kill -9 of a worker, a new version of a model copied in, a corrupt version, unload and load by request,
   a burst past the queue, SIGSTOP of a worker for longer than the request deadline, then SIGCONT;
3. settle (two tenths): traffic on, no faults; the leak checks read its last samples;
4. stop: SIGTERM under traffic; the server must exit 0 and leave no worker behind.

Every second a sampler records the HTTP process's resident memory, descriptors, threads and memfd lanes, each
child's memory and state, and /models and /gpu. tools/chaos/report.py then checks the run (what must hold is
in its docstring), writes chaos.json and chaos.png, and prints the summary. Exit status 0 if every check
passes, 1 if one fails, 2 if the run could not be made.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from tools import ROOT
from tools.chaos import report as chaos_report
from tools.chaos import traffic as chaos_traffic
from tools.images import make_images
from tools.server import ServerProcess, write_settings

MODELS = chaos_traffic.MODELS
CAP_MIB, OVERHEAD_MIB = 1024, 300
BUDGET_MIB = 2 * (CAP_MIB + OVERHEAD_MIB) + 100  # two workers fit, three do not
# The server's settings for the run, beside model_repository. Chaos kills workers on purpose, far past the
# give-up rule a production server keeps (5 exits in 300 s): a 10 s window keeps restarts coming, the
# backoff short, and the requests of a killed worker within their deadline.
SETTINGS = {
    "default_model": "shapes", "gpu_memory": f"{CAP_MIB}MiB", "gpu_total_mib": BUDGET_MIB,
    "gpu_overhead_mib": OVERHEAD_MIB, "idle_unload_s": 20.0, "model_poll_s": 1.0, "spare_workers": 1,
    "max_failures": 1000, "failure_window_s": 10.0, "restart_backoff_s": 0.5, "request_deadline_s": 15.0,
    "max_queue": 64, "header_timeout_s": 4.0, "body_timeout_s": 6.0, "shutdown_grace_s": 20.0,
    "log_level": "INFO",
}
STOP_SECONDS = 5.0  # SIGSTOP of a worker: past max_batch_delay, short of the request deadline (its calls wait)
FAULTS = {"kill-worker": 5, "new-version": 2, "corrupt-version": 1, "unload-load": 2, "burst": 2, "stop-worker": 2}
BURST = 160  # connections at once, past max_queue images


def request(port: int, method: str, path: str, body: bytes = b"", timeout_s: float = 30.0) -> tuple[int, dict]:
    """One control request over chaos_traffic's exchange; the answer's JSON ({} if it has none)."""
    status, _, data = chaos_traffic.http_exchange(port, method, path, body, timeout_s=timeout_s)
    try:
        return status, json.loads(data or b"{}")
    except ValueError:
        return status, {}


# The server's processes, read from /proc -----------------------------------------------------------------

def process_state(pid: int) -> Optional[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def rss_mib(pid: int, field: str = "VmRSS") -> Optional[float]:
    """A resident-memory line of /proc/PID/status in MiB: VmRSS (all), RssAnon (private heap), RssShmem."""
    try:
        found = re.search(rf"^{field}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return None
    return round(int(found.group(1)) / 1024, 1) if found else None


def http_process_figures(pid: int) -> dict:
    """The HTTP process's memory, descriptors, threads and the memfd lanes it has mapped (by inode)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    lanes = {m.group(1) for m in re.finditer(r"^\S+ \S+ \S+ \S+ (\d+) +/memfd:detect-", maps, re.M)}
    return {"rss_mib": rss_mib(pid), "anon_mib": rss_mib(pid, "RssAnon"), "shmem_mib": rss_mib(pid, "RssShmem"),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task")), "lanes": len(lanes)}


class Sampler:
    """Every second: the HTTP process, each child (memory, state, role), /models and /gpu."""

    def __init__(self, server: ServerProcess, t0: float):
        self.server, self.t0 = server, t0
        self.samples: list[dict] = []
        self.roles: dict[int, str] = {}  # every pid ever seen as a worker or spare
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-sampler", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.samples.append(self.sample())
            except (OSError, ValueError, KeyError, http.client.HTTPException):
                if self.server.process.poll() is not None:
                    return
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))

    def sample(self) -> dict:
        pid = self.server.pid
        _, listing = request(self.server.port, "GET", "/models", timeout_s=10)
        _, gpu = request(self.server.port, "GET", "/gpu", timeout_s=10)
        roles = {m["pid"]: m["name"] for m in listing["models"] if m["pid"]}
        roles.update({w["pid"]: w["model"] for w in gpu.get("workers", []) if w.get("pid")})
        roles.update({s["pid"]: "spare" for s in listing.get("spares", []) if s.get("pid")})
        kids = {}
        for child in self.server.pids()[1:]:  # its children: workers and spares
            role = roles.get(child)
            if role is None:  # a spare taken for a load is a worker before /models names it; else just started
                role = "loading" if self.roles.get(child) == "spare" else "?"
            if role not in ("?", "loading") and self.roles.get(child) in (None, "?", "spare"):
                self.roles[child] = role
            self.roles.setdefault(child, role)
            kids[str(child)] = {"role": role, "state": process_state(child), "rss_mib": rss_mib(child)}
        return {
            "t": round(time.monotonic() - self.t0, 2), "http": http_process_figures(pid), "children": kids,
            "models": {m["name"]: {k: m[k] for k in ("state", "version", "pid", "in_flight", "queue_depth")}
                       for m in listing["models"]},
            "spares": [s.get("pid") for s in listing.get("spares", [])],
            "budget": gpu.get("budget"),
        }


# Faults ------------------------------------------------------------------------------------------------

class Faults:
    """The fault injector: draws faults with the run's seed, applies them, and records each with its time."""

    def __init__(self, server: ServerProcess, repository: Path, seed: int, t0: float, weights: dict):
        self.server, self.repository, self.t0, self.weights = server, repository, t0, weights
        self.rng = random.Random(seed)
        self.events: list[dict] = []
        self._corrupt_count = 0

    def record(self, fault: str, **detail) -> None:
        event = {"t": round(time.monotonic() - self.t0, 2), "fault": fault, **detail}
        self.events.append(event)
        print(f"chaos: {event['t']:7.1f} s  {fault} {json.dumps(detail)}", file=sys.stderr, flush=True)

    def next(self) -> None:
        kinds, weights = zip(*self.weights.items())
        fault = self.rng.choices(kinds, weights)[0]
        getattr(self, fault.replace("-", "_"))()

    def _live_workers(self) -> list[tuple[str, int]]:
        _, listing = request(self.server.port, "GET", "/models")
        return [(m["name"], m["pid"]) for m in listing["models"] if m["pid"] and m["state"] == "ready"]

    def kill_worker(self) -> None:
        workers = self._live_workers()
        if not workers:
            return self.record("kill-worker", skipped="no worker ready")
        model, pid = self.rng.choice(workers)
        os.kill(pid, signal.SIGKILL)
        # A worker group's worker serves several models: the kill is each one's.
        self.record("kill-worker", model=model, pid=pid, models=sorted(m for m, p in workers if p == pid))

    def stop_worker(self) -> None:
        workers = self._live_workers()
        if not workers:
            return self.record("stop-worker", skipped="no worker ready")
        model, pid = self.rng.choice(workers)
        os.kill(pid, signal.SIGSTOP)
        self.record("stop-worker", model=model, pid=pid, seconds=STOP_SECONDS)
        time.sleep(STOP_SECONDS)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self.record("continue-worker", model=model, pid=pid)

    def _next_version(self, model: str) -> tuple[Path, int]:
        folder = self.repository / model
        numbers = [int(p.name) for p in folder.iterdir() if p.name.isdigit()]
        return folder, max(numbers) + 1

    def new_version(self) -> None:
        model = self.rng.choice(MODELS)
        folder, number = self._next_version(model)
        good = max((int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / "variables").is_dir()))
        staging = folder.parent / f".{model}-{number}"
        shutil.copytree(folder / str(good), staging)
        staging.rename(folder / str(number))  # whole at once, as a deployment tool would land it
        self.record("new-version", model=model, version=number)

    def corrupt_version(self) -> None:
        model = self.rng.choice(MODELS)
        folder, number = self._next_version(model)
        staging = folder.parent / f".{model}-{number}"
        staging.mkdir()
        (staging / "saved_model.pb").write_bytes(b"this is not a SavedModel" * 40)
        staging.rename(folder / str(number))
        self.record("corrupt-version", model=model, version=number)

    def unload_load(self) -> None:
        model = self.rng.choice(MODELS)
        self.record("unload", model=model)
        status, _ = request(self.server.port, "POST", f"/v2/repository/models/{model}/unload", timeout_s=60)
        self.record("unloaded", model=model, status=status)
        time.sleep(2.0)
        # As an operator would: a load refused for want of budget (503, Retry-After) is asked again.
        for attempt in range(1, 31):
            status, answer = request(self.server.port, "POST", f"/v2/repository/models/{model}/load", timeout_s=120)
            if status != 503:
                break
            time.sleep(1.0)
        self.record("load", model=model, status=status, attempts=attempt,
                    **({"error": answer.get("error")} if status != 200 else {}))

    def burst(self, record: bool = True) -> list:
        """BURST raw /detect requests at once; return their statuses (200; 503 with Retry-After; else -503, or
        what went wrong with the connection)."""
        scene = next(iter(sorted((self.repository.parent / "images").glob("scene-*.jpg")))).read_bytes()
        statuses: list[int] = []

        def one():
            try:
                status, headers, _ = chaos_traffic.http_exchange(self.server.port, "POST", "/detect", scene,
                                                                 {"Content-Type": "image/jpeg"})
                statuses.append(status if status != 503 or headers.get("retry-after") else -503)
            except OSError as exc:
                statuses.append(chaos_traffic.failure(exc))

        threads = [threading.Thread(target=one) for _ in range(BURST)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        counts = {str(s): statuses.count(s) for s in set(statuses)}
        self.record("burst" if record else "warm-up burst", connections=BURST, statuses=counts)
        return statuses


    def grpc_burst(self, calls: int = 32) -> None:
        """At the warm-up, `calls` ModelInfer calls and as many one-request streams at once, so that gRPC's pools
        (calls, streams: app/grpc/calls.py) grow to a working size before the leak checks' baseline."""
        scene = next(iter(sorted((self.repository.parent / "images").glob("scene-*.jpg")))).read_bytes()
        client = chaos_traffic.GrpcClient(self.server.grpc_port)
        statuses: list = []

        def one(kind: str) -> None:
            statuses.append(client.send(kind, "shapes", [scene]).status)

        threads = [threading.Thread(target=one, args=(kind,)) for kind in ("grpc-kserve", "grpc-stream")
                   for _ in range(calls)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        client.close()
        self.record("warm-up grpc burst", calls=2 * calls, statuses={str(s): statuses.count(s) for s in set(statuses)})


# The run -----------------------------------------------------------------------------------------------

def prepare(out: Path, seed: int) -> tuple[Path, Path]:
    """The repository copy and the images (8 scenes of 640 x 480 and one 12 MP photo)."""
    repository = out / "repo"
    if repository.exists():
        shutil.rmtree(repository)
    for model in MODELS:
        shutil.copytree(ROOT / "models" / model / "1", repository / model / "1")
    images = out / "images"
    make_images(images, count=8, seed=seed)
    photo = images / "photo-12mp.jpg"
    if not photo.exists():
        make_images(out / "photo", count=1, seed=seed, size=(4032, 3024))
        shutil.move(out / "photo" / "scene-00.jpg", photo)
    return repository, images


def start_clients(server: ServerProcess, args, images: Path, out: Path, stop_file: Path) -> list:
    clients, epoch = [], time.time()
    for i in range(args.clients):
        command = [sys.executable, "-m", "tools.chaos.traffic", "--port", str(server.port),
                   "--grpc-port", str(server.grpc_port), "--images", str(images),
                   "--references", str(out / "references.json"), "--out", str(out / f"requests-{i}.jsonl"),
                   "--threads", str(args.threads), "--seed", str(args.seed * 100 + i), "--stop-file", str(stop_file),
                   "--epoch", str(epoch), "--first-thread", str(i * args.threads),
                   "--header-timeout-s", str(SETTINGS["header_timeout_s"]),
                   "--body-timeout-s", str(SETTINGS["body_timeout_s"])]
        clients.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                        stderr=open(out / f"client-{i}.log", "w")))
    return clients


def run(args) -> dict:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("requests-*.jsonl"):
        old.unlink()
    repository, images = prepare(out, args.seed)
    settings = write_settings(out / "server.toml", {"model_repository": str(repository), **SETTINGS})
    if args.group:  # these models share one worker: a [models.<name>] table each naming the group
        with (out / "server.toml").open("a") as handle:
            handle.write("".join(f'[models.{name}]\nworker_group = "chaos"\n' for name in args.group))
    warmup_s, chaos_s = max(15.0, args.duration * 0.1), args.duration * 0.7
    settle_s = args.duration - warmup_s - chaos_s
    print(f"chaos: seed {args.seed}, {args.duration:.0f} s: warm-up {warmup_s:.0f}, chaos {chaos_s:.0f}, settle "
          f"{settle_s:.0f}, then SIGTERM under traffic; {args.clients} client processes x {args.threads} threads; "
          f"out {out}", file=sys.stderr, flush=True)
    server = ServerProcess.start(out / "server.toml", out / "server.log")
    t0 = time.monotonic()
    stop_file = out / "clients.stop"
    stop_file.unlink(missing_ok=True)
    sampler = Sampler(server, t0).start()
    faults = Faults(server, repository, args.seed, t0, args.faults)
    clients: list = []
    phases = {}
    try:
        refs = chaos_traffic.references(server.port, server.grpc_port, chaos_traffic.Images(images))
        (out / "references.json").write_text(json.dumps(refs))
        phases["warm-up"] = round(time.monotonic() - t0, 2)
        clients = start_clients(server, args, images, out, stop_file)
        time.sleep(warmup_s / 2)
        faults.burst(record=False)  # the thread pools grow to their size before the baseline
        faults.grpc_burst()  # and gRPC's: its calls and its streams each have a pool of their own
        _sleep_until(t0 + phases["warm-up"] + warmup_s)
        phases["chaos"] = round(time.monotonic() - t0, 2)
        chaos_end = t0 + phases["chaos"] + chaos_s
        while time.monotonic() < chaos_end - args.fault_every_s / 2:
            faults.next()
            _sleep_until(min(chaos_end, time.monotonic() + args.fault_every_s * faults.rng.uniform(0.5, 1.5)))
        _sleep_until(chaos_end)
        phases["settle"] = round(time.monotonic() - t0, 2)
        _sleep_until(t0 + phases["settle"] + settle_s)
        dropped = dropped_images(server.port)
        phases["stop"] = round(time.monotonic() - t0, 2)
        faults.record("sigterm", pid=server.pid)
        exit_status = server.stop(timeout_s=SETTINGS["shutdown_grace_s"] + 30)
        phases["end"] = round(time.monotonic() - t0, 2)
    finally:
        stop_file.touch()
        for client in clients:
            try:
                client.wait(timeout=chaos_traffic.TIMEOUT_S + 30)
            except subprocess.TimeoutExpired:
                client.kill()
        sampler.stop()
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
    time.sleep(1.0)
    left = {pid: role for pid, role in sampler.roles.items() if process_state(pid) not in (None,)}
    return {
        "dropped_images": dropped,
        "seed": args.seed, "duration_s": args.duration, "date": time.strftime("%Y-%m-%d"),
        "command": "scripts/chaos " + " ".join(args.argv), "settings": SETTINGS, "group": args.group,
        "budget_mib": BUDGET_MIB, "cap_mib": CAP_MIB, "overhead_mib": OVERHEAD_MIB,
        "phases": phases, "faults": faults.events, "exit_status": exit_status, "left_behind": left,
        "samples": sampler.samples, "t0_unix": time.time() - (time.monotonic() - t0),
        "lanes_per_worker": settings["inference_threads"], "http_threads": settings["http_threads"],
    }


def dropped_images(port: int) -> Optional[int]:
    """The images the server dropped from its queues because their client had gone (its /metrics), or None."""
    try:
        status, _, data = chaos_traffic.http_exchange(port, "GET", "/metrics", timeout_s=30)
    except OSError:
        return None
    if status != 200:
        return None
    text = data.decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("detect_dropped_images_total{")))


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def group_of(text: str) -> list[str]:
    """Parse --group: two or more of the run's models, comma-separated."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if len(names) < 2 or any(n not in MODELS for n in names):
        raise argparse.ArgumentTypeError(f"expected two or more of {', '.join(MODELS)}, comma-separated")
    return names


def fault_weights(text: str) -> dict:
    """Parse --faults: 'burst=5,kill-worker=2' -> {'burst': 5, 'kill-worker': 2}; kinds from FAULTS only."""
    weights = {}
    for item in text.split(","):
        kind, _, weight = (part.strip() for part in item.partition("="))
        if kind not in FAULTS or not weight.isdigit() or int(weight) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: want KIND=WEIGHT with KIND one of {', '.join(FAULTS)} "
                                             "and WEIGHT a whole number from 1")
        weights[kind] = int(weight)
    return weights


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of the run, stop excluded")
    parser.add_argument("--seed", type=int, default=28)
    parser.add_argument("--fault-every-s", type=float, default=6.0, help="mean gap between faults (s)")
    parser.add_argument("--clients", type=int, default=3, help="client processes")
    parser.add_argument("--threads", type=int, default=8, help="threads (connections) per client process")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "chaos", help="output folder")
    parser.add_argument("--faults", type=fault_weights, default=dict(FAULTS), metavar="KIND=WEIGHT,...",
                        help="the faults drawn and their weights (default: "
                        + ",".join(f"{k}={v}" for k, v in FAULTS.items()) + ")")
    parser.add_argument("--group", type=group_of, default=[], metavar="MODEL,MODEL",
                        help="run these models in one worker group, one worker for them all (default: a worker each)")
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        result = run(args)
    except (RuntimeError, OSError) as exc:
        print(f"chaos: error: {exc}", file=sys.stderr)
        return 2
    report = chaos_report.report(result, sorted(args.out.resolve().glob("requests-*.jsonl")))
    (args.out / "chaos.json").write_text(json.dumps({**report, "samples": result["samples"]}, indent=1))
    chaos_report.plot(result, report, args.out / "chaos.png")
    chaos_report.print_summary(report)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
