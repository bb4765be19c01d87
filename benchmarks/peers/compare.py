"""Compare this service with Ray Serve, KServe's Python server and MLServer, side by side, one at a time.

For each system in turn: start it (a session of its own), wait until it answers, check its boxes against
this service's on the same JPEG, warm it up, drive it with tools/loadgen.py at 1 and at 64 connections
for --duration seconds each, sampling the resident memory of its whole process tree from /proc (RSS and
and PSS, and its resident pages counted once, benchmarks/peers/proctree.py), then stop it (SIGTERM, SIGKILL of what is left after 30 s) and check
that no process of it is left. Before the systems, the in-process single-image latency and ceiling
(tools/ceiling.py's measure_ceiling: decode plus the model, no HTTP) are measured in the same run, so the
issue's goals can be checked from one run. Writes results.json, results.md and results.png to --out.

    benchmarks/peers/run [--model models/shapes] [--systems service,service-fp32,service-no-spare,ray,kserve,mlserver]
        [--duration 15] [--out out/peers] [--service-root PATH] [--setup] [--smoke]

Every timed figure carries the load average taken with it: the machine is shared.
Exit status: 0 done (goals are reported, never enforced), 1 a system failed its check or left a process
behind, 2 the run could not start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from app.inference.accelerators import NATIVE_BF16_FLAGS, read_cpu
from benchmarks.peers import proctree, systems
from tools import ROOT, loadgen
from tools.ceiling import run_ceiling
from tools.images import make_images
from tools.samplers import StatsSampler, load_average

HERE = Path(__file__).resolve().parent

CONNECTIONS = (1, 64)
# Photos of COCO objects (a person, a cat, a cup, a motorcycle, a rocket) from scikit-image's data, cut to 4:3:
# the generated scenes hold only circles, squares, triangles and stars, which a COCO detector finds nothing in.
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "motorcycle_left.png", "rocket.jpg")
DEFAULT_SYSTEMS = ("service", "service-fp32", "service-no-spare", "ray", "kserve", "mlserver")
READY_TIMEOUT_S = 300.0


def measure(system: systems.System, args, images: Path, work: Path, reference: list) -> dict:
    """Start one system, check it, drive it at each connection count, stop it; return its figures."""
    how = systems.launch(system, args.model, args.service_root, args.venvs, work)
    log = work / f"{system.name}.log"
    started = time.monotonic()
    with log.open("wb") as handle:
        process = subprocess.Popen(how.command, cwd=how.cwd, env=how.env, stdout=handle, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    row = {"system": system.name, "title": system.title, "settings": system.settings, "log": str(log),
           "pid": process.pid}
    seen: dict[int, int] = {}  # every process of its tree (pid: start time)
    try:
        jpeg = sorted(images.glob("*.jpg"))[0].read_bytes()
        detections = wait_ready(how, process, system, jpeg)
        row["ready_s"] = round(time.monotonic() - started, 1)
        row["check"] = check(detections, reference)
        if not reference:
            reference.extend(detections)
        progress(f"{system.name}: ready in {row['ready_s']} s, {len(detections)} detections; check: {row['check']}")
        step(how, images, work, 4, args.warmup, "warm-up", process.pid)
        row["at_rest"] = {**proctree.sample(process.pid, unique=True), "load_average": load_average()}
        row["steps"] = []
        for connections in CONNECTIONS:
            figures = step(how, images, work, connections, args.duration, f"{system.name} c={connections}",
                           process.pid)
            seen.update(figures.pop("seen"))
            row["steps"].append(figures)
            progress(f"{system.name}: {connections:3d} connections: {figures['images_per_s']:7.1f} img/s, p50 "
                     f"{figures['p50_ms']} ms, p99 {figures['p99_ms']} ms, memory {figures['unique_mib_peak']} MiB "
                     f"(RSS {figures['rss_mib_peak']:.0f}, PSS {figures['pss_mib_peak']:.0f}) in "
                     f"{figures['processes']} processes, errors "
                     f"{figures['errors']}; load average {figures['load_average']['after']}")
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"{system.name}: FAILED: {row['error']} (log: {log})")
    finally:
        row["stop"] = proctree.stop_started(process, seen)
        progress(f"{system.name}: stopped ({row['stop']['exit']}); left behind: {row['stop']['left'] or 'none'}")
    return row


def wait_ready(how: systems.Launch, process: subprocess.Popen, system: systems.System, jpeg: bytes) -> list:
    """Poll the system with a real request until it answers; for this service, also until its spares are up."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"it exited with status {process.returncode}")
        try:
            detections = how.ask(jpeg)
        except (OSError, ValueError, KeyError):
            time.sleep(0.5)
            continue
        while system.spare_workers and not systems.spares_ready(how.port, system.spare_workers):
            if time.monotonic() > deadline:
                raise RuntimeError("its spare workers were not ready in time")
            time.sleep(0.5)  # a spare importing TensorFlow would take CPU from the measurement
        return detections
    raise RuntimeError(f"it did not answer within {READY_TIMEOUT_S:.0f} s")


def check(detections: list, reference: list) -> str:
    """'ok', or what is wrong with an answer: no boxes, or boxes unlike this service's on the same image."""
    if not detections:
        return "no detections"
    if not reference:
        return "ok (the reference)"
    problem = systems.same_boxes(reference, detections)
    return "ok (same boxes as the first system)" if problem is None else f"differs: {problem}"


def step(how: systems.Launch, images: Path, work: Path, connections: int, duration_s: float, label: str,
         leader: int) -> dict:
    """Drive the system for duration_s with this many connections, sampling its process tree; return figures."""
    out = work / "step.json"
    before = load_average()
    # Reading every page table of a tree takes CPU from it (a tenth of a second per TensorFlow process):
    # the resident pages are counted 10 s into the step and just after it, the rest every 0.5 s.
    tree = proctree.Tree(leader, unique_every=20)
    with StatsSampler(tree) as sampler:
        spawned = loadgen.spawn(how.port, images, out, connections, duration_s, label=label, timeout_s=60.0,
                                **how.loadgen)
        result = loadgen.collect(spawned, out, duration_s + 120)
    latency = result["latency_ms"]
    peak = proctree.peak(sampler.samples + [proctree.sample(leader, unique=True)])
    return {"connections": connections, "images_per_s": result["ok_per_s"], "p50_ms": latency["p50"],
            "p99_ms": latency["p99"], "requests": result["requests"], "statuses": result["statuses"],
            "errors": result["error_total"], "unique_mib_peak": peak["unique_mib"], "rss_mib_peak": peak["rss_mib"],
            "pss_mib_peak": peak["pss_mib"],
            # The load generator runs on the same CPUs: the share of them it took is not the system's.
            "client_cpu_percent": round(100 * result["client_cpu_s"] / max(result["elapsed_s"], 1e-9)
                                        / (os.cpu_count() or 1), 1),
            "processes": peak["processes"], "load_average": {"before": before, "after": load_average()},
            "seen": tree.seen}


def photo_images(folder: Path) -> Path:
    """Write the PHOTOS as 640x480 JPEGs (the middle 4:3 of each, resized; quality 90) to `folder`."""
    import skimage
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for name in PHOTOS:
        with Image.open(Path(skimage.data_dir) / name) as image:
            image = image.convert("RGB")
            width, height = image.size
            keep = (width, round(width * 3 / 4)) if width * 3 <= height * 4 else (round(height * 4 / 3), height)
            left, top = (width - keep[0]) // 2, (height - keep[1]) // 2
            image.crop((left, top, left + keep[0], top + keep[1])).resize((640, 480), Image.LANCZOS).save(
                folder / f"{Path(name).stem}.jpg", quality=90)
    return folder


def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


# --- goals, table and plot ---------------------------------------------------------------------------

def at(row: dict, connections: int) -> dict:
    return next((s for s in row.get("steps", []) if s["connections"] == connections), {})


def memory_of(row: dict) -> dict:
    """The row's peak memory over its load steps: {"unique_mib", "rss_mib", "pss_mib", "processes"}."""
    steps = row.get("steps") or []
    return {key: max((s[f"{key}_peak"] if key != "processes" else s[key] for s in steps
                      if s.get(f"{key}_peak", s.get(key)) is not None), default=None)
            for key in ("unique_mib", "rss_mib", "pss_mib", "processes")}


def goals(result: dict) -> list[dict]:
    """The issue's goals, checked on this run's figures (None where a figure is missing)."""
    rows = {row["system"]: row for row in result["systems"] if not row.get("error") and row.get("steps")}
    ceiling = result["ceiling"]
    service, lean, kserve = rows.get("service"), rows.get("service-no-spare"), rows.get("kserve")
    peers = [rows[p] for p in systems.PEERS if p in rows]
    best_peer = max(peers, key=lambda r: at(r, 64).get("images_per_s") or 0, default=None)
    out = []

    def goal(text: str, measured: str, met) -> None:
        out.append({"goal": text, "measured": measured, "met": met})

    if service:
        p50 = at(service, 1).get("p50_ms")
        limit = ceiling["single_image_ms_p50"] + 1
        goal("p50 at 1 connection <= in-process single image + 1 ms", f"{p50} ms against {limit:.2f} ms",
             p50 is not None and p50 <= limit)
        rate = at(service, 64).get("images_per_s")
        goal("img/s at 64 >= 1.0 x in-process ceiling", f"{rate} against {ceiling['images_per_s']}",
             rate is not None and rate >= ceiling["images_per_s"])
        # The ceiling is the model run as saved_model.load runs it, in fp32; the precision auto chose must beat
        # it where the CPU has native bf16 (issue 38), and cost nothing where it has not.
        goal("img/s at 64 >= 1.25 x the in-process fp32 ceiling (precision auto, on a CPU with native bf16)",
             f"{rate} against 1.25 x {ceiling['images_per_s']}",
             None if not result["machine"].get("native_bf16") else rate is not None
             and rate >= 1.25 * ceiling["images_per_s"])
        if kserve:
            theirs = at(kserve, 1).get("p50_ms")
            goal("p50 at 1 connection <= KServe's", f"{p50} ms against {theirs} ms",
                 None if theirs is None else p50 <= theirs)
        if best_peer:
            theirs = at(best_peer, 64).get("images_per_s")
            goal("img/s at 64 >= 1.5 x the best peer's", f"{rate} against 1.5 x {theirs} ({best_peer['system']})",
                 rate >= 1.5 * theirs)
    if lean and kserve:
        for when, figures in (("at rest", lambda r: r["at_rest"]), ("peak under load", memory_of)):
            ours, theirs = figures(lean), figures(kserve)
            for key, name in (("unique_mib", "resident pages counted once"), ("rss_mib", "RSS summed")):
                if ours.get(key) is None or theirs.get(key) is None:
                    continue
                goal(f"memory {when}, spare_workers = 0, <= 1.2 x KServe's ({name})",
                     f"{ours[key]:.0f} MiB against 1.2 x {theirs[key]:.0f} MiB", ours[key] <= 1.2 * theirs[key])
    return out


def table(result: dict) -> str:
    """The Markdown table of results.md."""
    ceiling = result["ceiling"]
    bf16 = ", native bf16" if result["machine"].get("native_bf16") else ""
    lines = [
        f"Model `{result['model']}`, {result['images']}, {result['duration_s']:g} s per step, "
        f"{result['machine']['cpus']} CPUs ({result['machine']['processor']}{bf16}), {result['date']}.",
        "",
        f"In-process (decode + model, no HTTP, same run): single image p50 {ceiling['single_image_ms_p50']} ms, "
        f"ceiling {ceiling['images_per_s']} img/s (batch {ceiling['best_batch']}, {ceiling['best_threads']} "
        f"thread(s)); load average {ceiling['load_average']}.",
        "",
        "| system | img/s at 64 | p50 / p99 at 1 (ms) | p50 / p99 at 64 (ms) | memory at rest, MiB: resident "
        "(RSS summed, PSS summed) | memory, peak under load | processes | load average (1 min) at 1 / 64 "
        "| load generator's share of the CPUs at 1 / 64 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["systems"]:
        if row.get("skipped"):
            lines.append(f"| {row['title']} | skipped: {row['skipped']} | | | | | | | |")
            continue
        if row.get("error"):
            lines.append(f"| {row['title']} | failed: {row['error']} | | | | | | | |")
            continue
        one, many, memory, rest = at(row, 1), at(row, 64), memory_of(row), row["at_rest"]
        errors = sum(s["errors"] for s in row["steps"])
        lines.append(
            f"| {row['title']} | {many.get('images_per_s')}{f' ({errors} errors)' if errors else ''} "
            f"| {one.get('p50_ms')} / {one.get('p99_ms')} | {many.get('p50_ms')} / {many.get('p99_ms')} "
            f"| {_mib(rest.get('unique_mib'))} ({rest['rss_mib']:.0f}, {rest['pss_mib']:.0f}) "
            f"| {_mib(memory['unique_mib'])} ({memory['rss_mib']:.0f}, {memory['pss_mib']:.0f}) "
            f"| {memory['processes']} "
            f"| {one['load_average']['after'][0]} / {many['load_average']['after'][0]} "
            f"| {_percent(one.get('client_cpu_percent'))} / {_percent(many.get('client_cpu_percent'))} |")
    lines += ["", "Memory of the whole process tree, from `/proc`, at rest after the warm-up and the peak over the "
              "two load steps: its resident pages counted once (page frames from `/proc/<pid>/pagemap`), then "
              "VmRSS summed (a page shared by n processes counted n times) and Pss summed (a shared page divided "
              "among every process on the machine that maps it, in the tree or not).", ""]
    for item in result["goals"]:
        verdict = {True: "met", False: "**not met**", None: "not measured"}[item["met"]]
        lines.append(f"- {item['goal']}: {verdict} ({item['measured']})")
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Bars per system: img/s at 64 (the ceiling as a line), p50 at 1 (in-process as a line), PSS and RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["systems"] if r.get("steps")]
    names = [r["system"] for r in rows]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    left.bar(names, [at(r, 64).get("images_per_s") or 0 for r in rows], color="tab:blue")
    left.axhline(result["ceiling"]["images_per_s"], color="grey", linestyle=":", label="in-process ceiling")
    left.set_title("Throughput at 64 connections")
    left.set_ylabel("images/s")
    middle.bar(names, [at(r, 1).get("p50_ms") or 0 for r in rows], color="tab:orange")
    middle.axhline(result["ceiling"]["single_image_ms_p50"], color="grey", linestyle=":",
                   label="in-process single image")
    middle.set_title("p50 latency at 1 connection")
    middle.set_ylabel("ms")
    xs = range(len(rows))
    right.bar([x - 0.3 for x in xs], [r["at_rest"].get("unique_mib") or 0 for r in rows], 0.3, label="at rest")
    right.bar(list(xs), [memory_of(r)["unique_mib"] or 0 for r in rows], 0.3, label="peak under load")
    right.bar([x + 0.3 for x in xs], [memory_of(r)["rss_mib"] or 0 for r in rows], 0.3, label="RSS summed, peak")
    right.set_xticks(list(xs), names)
    right.set_title("Resident memory of the whole process tree")
    right.set_ylabel("MiB")
    for ax in (left, middle, right):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    load = result["machine"]["load_average_start"]
    fig.suptitle(f"{Path(result['model']).name}, {result['images']}, {result['machine']['cpus']} CPUs, "
                 f"{result['date']}, load average at start {load[0]:.2f} (shared machine)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- main --------------------------------------------------------------------------------------------

def parse_args(argv):
    parser = argparse.ArgumentParser(prog="benchmarks/peers/run", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "shapes", help="model base path")
    parser.add_argument("--systems", default=None,
                        help=f"comma-separated, of {', '.join(systems.SYSTEMS)} (default all; --smoke: service)")
    parser.add_argument("--images", choices=("auto", "scenes", "photos"), default="auto",
                        help="16 generated scenes of shapes, or 5 photos of COCO objects (auto: scenes for the "
                             "shapes model, else photos)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per load step (15; --smoke: 2)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "peers")
    parser.add_argument("--service-root", type=Path, default=ROOT,
                        help="the checkout this service runs from (default: this one)")
    parser.add_argument("--venvs", type=Path, default=HERE / ".venvs", help="where the peers' venvs are")
    parser.add_argument("--setup", action="store_true", help="make the chosen peers' venvs first (pip, minutes)")
    parser.add_argument("--from-json", type=Path, default=None, metavar="RESULTS",
                        help="measure nothing: write results.md and results.png again from a results.json")
    parser.add_argument("--smoke", action="store_true", help="a quick run: 2 s steps, a 1 s ceiling, this service")
    args = parser.parse_args(argv)
    names = args.systems.split(",") if args.systems else (["service"] if args.smoke else list(DEFAULT_SYSTEMS))
    unknown = [n for n in names if n not in systems.SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(systems.SYSTEMS)}")
    args.systems = [systems.SYSTEMS[n] for n in names]
    args.duration = args.duration or (2.0 if args.smoke else 15.0)
    args.warmup = 1.0 if args.smoke else 5.0
    args.ceiling_seconds = 1.0 if args.smoke else 5.0
    args.model, args.service_root = args.model.resolve(), args.service_root.resolve()
    if args.images == "auto":
        args.images = "scenes" if args.model.name == "shapes" else "photos"
    args.venvs = args.venvs.resolve()
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out.resolve()
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        result["goals"] = goals(result)
        write(result, out)
        return 0
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    command = "benchmarks/peers/run " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.setup:
        for system in args.systems:
            if system.peer:
                systems.setup_venv(args.venvs, system.peer)
    load_start = load_average()
    progress(f"peers: model {args.model}, systems {', '.join(s.name for s in args.systems)}, {args.duration:g} s "
             f"steps, service from {args.service_root}; load average {load_start} on {os.cpu_count()} CPUs")
    images = make_images(out / "images") if args.images == "scenes" else photo_images(out / "photos")
    progress("measuring the in-process single image and ceiling (decode + model, no HTTP)")
    try:
        ceiling = run_ceiling(args.model, images, work / "ceiling.json", (1, 16), args.ceiling_seconds, (1, 2))
    except (RuntimeError, OSError) as exc:
        progress(f"error: {exc}")
        return 2
    ceiling["load_average"] = load_average()
    progress(f"in-process: single image {ceiling['single_image_ms_p50']} ms p50, ceiling {ceiling['images_per_s']} "
             f"img/s; load average {ceiling['load_average']}")
    rows, reference = [], []
    for system in args.systems:
        reason = systems.missing_venv(args.venvs, system.peer) if system.peer else None
        if reason:
            progress(f"{system.name}: skipped: {reason}")
            rows.append({"system": system.name, "title": system.title, "skipped": reason})
            continue
        row = measure(system, args, images, work, reference)
        row["version"] = systems.peer_version(args.venvs, system.peer) if system.peer else service_version(args)
        rows.append(row)
    result = {
        "model": os.path.relpath(args.model, ROOT) if args.model.is_relative_to(ROOT) else str(args.model),
        "images": ("16 generated 640x480 JPEG scenes" if args.images == "scenes" else
                   f"{len(PHOTOS)} 640x480 JPEG photos ({', '.join(Path(p).stem for p in PHOTOS)})"),
        "duration_s": args.duration, "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "processor": _processor(), "native_bf16": _native_bf16(),
                    "load_average_start": load_start,
                    "load_average_end": load_average()},
        "service_root": str(args.service_root), "ceiling": ceiling, "systems": rows,
    }
    result["goals"] = goals(result)
    write(result, out)
    failed = [r["system"] for r in rows if r.get("error") or (r.get("check") or "ok").startswith(("no ", "differs"))
              or (r.get("stop") or {}).get("left")]
    if failed:
        progress(f"failed: {', '.join(failed)}")
        return 1
    return 0


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(table(result))
    plot(result, out / "results.png")
    progress(f"wrote {out / 'results.json'}, results.md and results.png")
    print(table(result))


def _mib(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def _percent(value) -> str:
    return "-" if value is None else f"{value:g}%"


def service_version(args) -> str:
    done = subprocess.run(["git", "-C", str(args.service_root), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True)
    return f"commit {done.stdout.strip() or 'unknown'} of {args.service_root}"


def _processor() -> str:
    return read_cpu()[1] or platform.machine()


def _native_bf16() -> bool:
    return any(flag in read_cpu()[0] for flag in NATIVE_BF16_FLAGS)


if __name__ == "__main__":
    sys.exit(main())
