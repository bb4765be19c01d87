"""Each shipped model in fp32, bf16 and XLA, in process, side by side: speed at batch 1, 4 and 16, and the answers.

    .venv/bin/python -m tools.precision [--models objects,faces,shapes] [--modes fp32,bf16,xla] [--seconds 5]
        [--out out/precision] [--from-json out/precision/results.json]

Each (model, mode) runs in a child process of its own, as a model's worker does, since both switches are
the process's: `bf16` is app/inference/accelerators.py's apply_precision, `xla` is XLA auto-clustering
(TF_XLA_FLAGS=--tf_xla_cpu_global_jit and tf.config.optimizer.set_jit), which the service does not offer
(docs/concepts/precision.md says why; it is measured here to show it). A child times per-image latency
of one model call at each batch size (the median over --seconds, the batch made of one reference photo
decoded as the server decodes it), then runs the parity comparison on the model's reference photos
against fp32 (app/inference/parity.py's compare) and, for objects, the photos whose boxes were measured
by hand (IoU of each mode's box with the hand-measured one). A child that dies (XLA aborts on faces) is
reported as such. Writes results.json, results.md and results.png to --out; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools import ROOT

MODES = ("fp32", "bf16", "xla")
BATCHES = (1, 4, 16)
MODELS = ("objects", "faces", "shapes")


def child(model: str, mode: str, seconds: float) -> dict:
    """Run in the child: time the model at each batch size in `mode`, and compare its answers with fp32's."""
    import numpy as np
    import tensorflow as tf

    from app.inference.accelerators import apply_precision
    from app.inference.detector import load_detector
    from app.inference.parity import GATE_THRESHOLD, SCORE_TOLERANCE, compare, decoded_reference
    from app.settings import Settings

    detector = load_detector(ROOT / "models" / model)
    photos = decoded_reference(detector.model.path, Settings().max_image_pixels)
    names, images = [n for n, _ in photos], [i for _, i in photos]

    def detect(floor: float) -> list:
        return detector.detect([i.pixels for i in images], floor, 1000, sizes=[(i.width, i.height) for i in images])

    floor = GATE_THRESHOLD - SCORE_TOLERANCE
    apply_precision("fp32")
    reference = detect(floor)
    hand = hand_measured(detector) if model == "objects" else {}
    if mode == "bf16":
        apply_precision("bf16")
    elif mode == "xla":
        tf.config.optimizer.set_jit("autoclustering")
    out = {"model": model, "mode": mode, "ms_per_image": {}, "photo": names[0]}
    pixels = images[0].pixels
    for batch in BATCHES:
        if detector.max_batch is not None and batch > detector.max_batch:
            continue
        block = np.stack([pixels] * batch)
        detector.run(block)
        detector.run(block)
        times = []
        stop = time.perf_counter() + seconds
        while len(times) < 5 or time.perf_counter() < stop:
            started = time.perf_counter()
            detector.run(block)
            times.append(time.perf_counter() - started)
        out["ms_per_image"][str(batch)] = round(1000 * statistics.median(times) / batch, 2)
        progress(f"{model} {mode} batch {batch}: {out['ms_per_image'][str(batch)]} ms per image ({len(times)} calls)")
    if mode != "fp32":
        out["parity"] = compare(names, reference, detect(floor), GATE_THRESHOLD).to_json()
        if hand:
            out["hand_measured"] = {name: {"fp32": iou_fp32, mode: hand_iou(detector, name)}
                                    for name, iou_fp32 in hand.items()}
    return out


def hand_measured(detector) -> dict:
    """IoU of the fp32 box of each hand-measured photo's object with the hand-measured box: {name: iou}."""
    return {name: hand_iou(detector, name) for name in _known()}


def _known() -> dict:
    from tools.export.objects import HAND_MEASURED

    return HAND_MEASURED


def hand_iou(detector, name: str) -> float:
    """IoU with the hand-measured box of the photo's object that best covers it, above 0.5 (0: none found)."""
    import numpy as np
    from PIL import Image
    import skimage

    from app.inference.detections import Box, box_iou

    filename, label, measured = _known()[name]
    truth = Box(*measured)
    pixels = np.asarray(Image.open(Path(skimage.__file__).parent / "data" / filename).convert("RGB"))
    found = [d for d in detector.detect([pixels], 0.5, 100)[0] if d.label == label]
    return round(max((box_iou(d.box, truth) for d in found), default=0.0), 4)


def run_child(model: str, mode: str, seconds: float) -> dict:
    """Run one (model, mode) in a child process; a child that dies says how."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    if mode == "xla":
        env["TF_XLA_FLAGS"] = "--tf_xla_cpu_global_jit"
    done = subprocess.run([sys.executable, "-m", "tools.precision", "--child", model, mode, "--seconds", str(seconds)],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sys.stderr.write("".join(line + "\n" for line in done.stderr.splitlines() if line.startswith("precision:")))
    if done.returncode != 0:
        fatal = [line for line in done.stderr.splitlines() if line.startswith(("F0", "Check failed"))
                 or "Error" in line]
        return {"model": model, "mode": mode, "error": f"exit status {done.returncode}: "
                f"{(fatal or ['no message'])[-1].strip()[:300]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def progress(line: str) -> None:
    print(f"precision: {line}", file=sys.stderr, flush=True)


def cpu() -> str:
    from app.inference.accelerators import NATIVE_BF16_FLAGS, read_cpu

    flags, name = read_cpu()
    has = [f for f in NATIVE_BF16_FLAGS if f in flags]
    return f"{os.cpu_count()} CPUs, {name or platform.machine()}, {', '.join(has) if has else 'no native bf16'}"


def table(result: dict) -> str:
    rows = {(r["model"], r["mode"]): r for r in result["runs"]}
    lines = [f"{result['machine']}, {result['date']}, {result['seconds']:g} s per figure; per-image time of one "
             "model call (median), the batch made of the model's first reference photo decoded as the server "
             "decodes it.", "",
             "| model | mode | " + " | ".join(f"batch {b}: ms per image (x fp32)" for b in BATCHES) + " |",
             "|---|---|" + "---|" * len(BATCHES)]
    for model in result["models"]:
        base = rows.get((model, "fp32"), {}).get("ms_per_image", {})
        for mode in result["modes"]:
            row = rows.get((model, mode))
            if row is None:
                continue
            if "error" in row:
                lines.append(f"| {model} | {mode} | failed: {row['error']} |" + " |" * (len(BATCHES) - 1))
                continue
            cells = []
            for batch in map(str, BATCHES):
                ms = row["ms_per_image"].get(batch)
                ratio = f" ({base[batch] / ms:.2f}x)" if ms and base.get(batch) and mode != "fp32" else ""
                cells.append("-" if ms is None else f"{ms}{ratio}")
            lines.append(f"| {model} | {mode} | " + " | ".join(cells) + " |")
    lines += ["", "Answers against fp32 on each model's reference photos (app/inference/parity.py's comparison, "
              "threshold 0.3, score tolerance 0.03, IoU at least 0.9):", "",
              "| model | mode | photos | detections | matched | largest score difference | smallest IoU | problems |",
              "|---|---|---|---|---|---|---|---|"]
    for model in result["models"]:
        for mode in result["modes"]:
            row = rows.get((model, mode), {})
            parity = row.get("parity")
            if parity:
                lines.append(f"| {model} | {mode} | {parity['photos']} | {parity['detections']} | {parity['matched']} "
                             f"| {parity['max_score_difference']} | {parity['min_iou']} "
                             f"| {'; '.join(parity['problems']) or 'none'} |")
    hand = [r for r in result["runs"] if r.get("hand_measured")]
    if hand:
        lines += ["", "objects, the photos whose boxes were measured by hand: IoU of the model's box with the "
                  "hand-measured box.", "", "| photo | fp32 | " + " | ".join(r["mode"] for r in hand) + " |",
                  "|---|---|" + "---|" * len(hand)]
        for name in hand[0]["hand_measured"]:
            lines.append(f"| {name} | {hand[0]['hand_measured'][name]['fp32']} | "
                         + " | ".join(str(r["hand_measured"][name][r["mode"]]) for r in hand) + " |")
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Per model, images per second per CPU call at each batch size, one bar per mode (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {(r["model"], r["mode"]): r for r in result["runs"]}
    fig, axes = plt.subplots(1, len(result["models"]), figsize=(5 * len(result["models"]), 3.8), squeeze=False)
    width = 0.8 / len(result["modes"])
    for ax, model in zip(axes[0], result["models"]):
        for i, mode in enumerate(result["modes"]):
            row = rows.get((model, mode), {})
            rates = [1000 / row["ms_per_image"][str(b)] if str(b) in row.get("ms_per_image", {}) else 0
                     for b in BATCHES]
            xs = [k + (i - (len(result["modes"]) - 1) / 2) * width for k in range(len(BATCHES))]
            ax.bar(xs, rates, width, label=mode)
            if "error" in row:
                for x in xs:
                    ax.text(x, 0, "aborted", rotation=90, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(BATCHES)), [f"batch {b}" for b in BATCHES])
        ax.set_title(model)
        ax.set_ylabel("images/s, one model call at a time")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['machine']}, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.precision", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seconds", type=float, default=5.0, help="timing per batch size (5)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "precision")
    parser.add_argument("--from-json", type=Path, default=None, metavar="RESULTS",
                        help="write the table and plot again from an earlier results.json")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.seconds)))
        return 0
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
    else:
        models, modes = args.models.split(","), args.modes.split(",")
        runs = []
        for model in models:
            for mode in modes:
                progress(f"{model} in {mode}: a child process of its own")
                runs.append(run_child(model, mode, args.seconds))
        result = {"machine": cpu(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "seconds": args.seconds, "models": models, "modes": modes, "runs": runs,
                  "command": "python -m tools.precision " + " ".join(argv if argv is not None else sys.argv[1:])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "results.md").write_text(table(result))
    print(table(result))
    try:
        plot(result, args.out / "results.png")
    except ImportError:  # matplotlib is the tools extra's; the table and the JSON stand without it
        progress("no plot: matplotlib is not installed (pip install -e '.[tools]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
