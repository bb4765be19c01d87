"""`python -m app calibrate`: measure a model's GPU memory under load and recommend a cap.

Two runs of the same synthetic load (the largest batch and image size the service admits, in as many
concurrent calls as `inference_threads` lets the service make: each call holds its own activations),
each in a fresh process, since a memory policy only takes effect before TensorFlow touches the GPU:

1. with memory growth: TensorFlow's peak (get_memory_info) and the process's NVML usage over time.
   The recommended cap is the peak plus headroom (20%).
2. under that cap: NVML used minus the cap is the per-process overhead (CUDA context, cuDNN/cuBLAS
   workspaces) that the fleet budgets as gpu_overhead_mib, and the run shows the load fits the cap.

`measure` is the GPU-side logic; its collaborators (NVML library, tf.config, the TensorFlow memory
reader, the model loader) are parameters so it can be exercised on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
import threading
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..errors import ConfigError, DetectError, MissingExtra, ModelError, NvmlUnavailable
from ..extras import require_extra
from ..gpu.memory_policy import MemorySpec, apply_policy, parse_memory_spec, tensorflow_memory_info

log = logging.getLogger("app.calibrate")

NEEDS_GPU = "calibration needs an NVIDIA GPU"
_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


class CalibrationError(DetectError):
    """Calibration cannot run here, or its load failed."""

    code = "calibration_failed"


@dataclass(frozen=True)
class Sample:
    """Memory at one moment of a run, in MiB."""

    t_s: float  # since the run's load began
    nvml_used_mib: Optional[float]  # this process on the GPU (NVML); None where it cannot be read
    tf_current_mib: Optional[float]
    tf_peak_mib: Optional[float]


@dataclass
class PhaseResult:
    """What one run measured."""

    policy: str  # "growth" or the cap, e.g. "1482MiB"
    batch: int
    width: int
    height: int
    requests: int = 0  # model calls that completed
    concurrent: int = 1  # calls in flight at once
    seconds: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    gpu_name: str = ""
    pid_visible: bool = True  # False: NVML never showed the pid; its figures are the GPU's change since start
    error: Optional[str] = None  # the load failed (out of memory, say)
    precision: str = "fp32"  # what the model computed at, settled as a worker settles it (app/inference/parity.py)
    precision_reason: str = ""

    @property
    def tf_peak_mib(self) -> Optional[float]:
        peaks = [s.tf_peak_mib for s in self.samples if s.tf_peak_mib is not None]
        return max(peaks) if peaks else None

    @property
    def nvml_peak_mib(self) -> Optional[float]:
        used = [s.nvml_used_mib for s in self.samples if s.nvml_used_mib is not None]
        return max(used) if used else None


@dataclass(frozen=True)
class Recommendation:
    """The answer: a cap, and the overhead each process needs beyond it."""

    cap_mib: int
    tf_peak_mib: float
    headroom_percent: float
    overhead_mib: Optional[int]  # None where the capped run could not measure it


def recommend_cap(tf_peak_mib: float, headroom_percent: float = 20.0) -> int:
    """Return the cap for a TensorFlow peak: peak plus headroom, rounded up to a whole MiB."""
    return max(1, math.ceil(tf_peak_mib * (1 + headroom_percent / 100)))


def measured_overhead(result: PhaseResult, cap_mib: int) -> Optional[int]:
    """Return the most NVML saw the process use beyond its cap in a capped run, or None."""
    beyond = [s.nvml_used_mib - cap_mib for s in result.samples
              if s.nvml_used_mib is not None and s.nvml_used_mib >= cap_mib]
    return math.ceil(max(beyond)) if beyond else None


def measure(spec: MemorySpec, model: str, gpu: int, batch: int, width: int, height: int, requests: int, *,
            concurrent: int = 1, nvml_library=None, tf_config=None, tf_memory: Optional[Callable[[], list[dict]]] = None,
            load: Optional[Callable] = None, pid: Optional[int] = None, interval_s: float = 0.1,
            execution: Optional[dict] = None) -> PhaseResult:
    """Apply `spec` to one GPU, load the model, run `requests` calls of one synthetic batch, and sample memory.

    `concurrent` threads share the calls, as the service's inference threads do. The model computes at the
    precision a worker would settle on for it: `execution` holds its `precision`, `parity_gate` and `threshold`
    (default: fp32), since fp16's activations are not fp32's.

    Call in a process whose TensorFlow has not touched the GPU yet. Raise CalibrationError where
    there is no GPU; a load that fails (out of memory) comes back as PhaseResult.error.
    """
    import numpy as np

    from ..process import configure_cuda_order, quiet_tensorflow_startup
    from ..gpu.nvml import Nvml

    configure_cuda_order()
    quiet_tensorflow_startup()
    try:
        nvml = Nvml.open(nvml_library)
    except NvmlUnavailable as exc:
        raise CalibrationError(f"{NEEDS_GPU}: {exc.message}") from None
    pid = os.getpid() if pid is None else pid
    read_tf = tf_memory or (lambda: tensorflow_memory_info(tf_config))
    try:
        (device,) = nvml.snapshot([gpu]) or [None]
        if device is None:
            raise CalibrationError(f"{NEEDS_GPU}: NVML sees no GPU {gpu}")
        baseline = device.memory_used_mib
        policy = apply_policy(spec, (gpu,), nvml.total_mib, tf_config=tf_config)
        if not policy.gpus:
            raise CalibrationError(f"{NEEDS_GPU}: {policy.note} (is this a CPU-only TensorFlow?)")
        if load is None:
            from ..inference.detector import load_detector as load
        detector = load(model)
        from ..inference.parity import settle_detector

        settled = settle_detector(detector, tf_config=tf_config, **_execution(execution))
        batch = min(batch, detector.max_batch or batch)
        height = detector.image_shape[1] or height  # a model with a fixed input size gets that size
        width = detector.image_shape[2] or width
        result = PhaseResult(policy=str(spec), batch=batch, width=width, height=height, gpu_name=device.name,
                             pid_visible=False, concurrent=concurrent, precision=settled.precision,
                             precision_reason=settled.reason)
        image = np.random.default_rng(0).integers(0, 256, (1, height, width, 3), dtype=np.uint8)
        images = np.repeat(image, batch, axis=0)
        started = time.monotonic()
        lock = threading.Lock()

        def sample():
            nvml_used = None
            try:
                (now,) = nvml.snapshot([gpu])
                own = [p.used_mib for p in now.processes if p.pid == pid and p.used_mib is not None]
                if own:
                    result.pid_visible = True
                    nvml_used = float(own[0])
                elif not result.pid_visible:  # never seen: the GPU's change since start stands in
                    nvml_used = float(now.memory_used_mib - baseline)
            except NvmlUnavailable:
                pass
            try:
                tf = next((entry for entry in read_tf() if "error" not in entry), {})
            except Exception:  # a figure missing from one sample must not end the run
                tf = {}
            with lock:
                result.samples.append(Sample(round(time.monotonic() - started, 3), nvml_used,
                                             tf.get("current_mib"), tf.get("peak_mib")))

        done = threading.Event()

        def sampler():
            while not done.wait(interval_s):
                sample()

        thread = threading.Thread(target=sampler, name="calibrate-sampler", daemon=True)
        sample()
        thread.start()
        unclaimed = [requests]
        failures: list[Exception] = []

        def caller():
            while True:
                with lock:
                    if unclaimed[0] <= 0 or failures:
                        return
                    unclaimed[0] -= 1
                try:
                    detector.run(images)
                except Exception as exc:  # the load itself failed: out of memory under a cap, typically
                    with lock:
                        failures.append(exc)
                    return
                with lock:
                    result.requests += 1
                sample()

        callers = [threading.Thread(target=caller, name=f"calibrate-call-{i}") for i in range(max(1, concurrent))]
        try:
            for call_thread in callers:
                call_thread.start()
            for call_thread in callers:
                call_thread.join()
        finally:
            done.set()
            thread.join()
            result.seconds = round(time.monotonic() - started, 3)
        if failures:
            kind = type(failures[0]).__name__
            first = (str(failures[0]).strip().splitlines() or [kind])[0]
            result.error = (f"out of memory under {spec}: {first}" if "ResourceExhausted" in kind
                            else f"the model failed: {kind}: {first}")
        sample()
        return result
    finally:
        nvml.close()


def _execution(execution: Optional[dict]) -> dict:
    """The precision settings `measure` settles the model with: fp32 unless given."""
    from ..settings import Settings

    defaults = Settings()
    return {"asked": "fp32", "gate": True, "threshold": defaults.default_threshold,
            "max_pixels": defaults.max_image_pixels, **(execution or {})}


def _phase_process(connection, spec_text, model, gpu, batch, width, height, requests, concurrent, execution) -> None:
    """Run `measure` in a fresh process and send back its result (or its error)."""
    logging.basicConfig(level="WARNING", stream=sys.stderr)
    try:
        result = measure(parse_memory_spec(spec_text), model, gpu, batch, width, height, requests,
                         concurrent=concurrent, execution=execution)
        connection.send(("ok", asdict(result)))
    except DetectError as exc:
        connection.send(("error", exc.message))
    except Exception as exc:  # anything else still ends the run with a message, not a hang
        connection.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        connection.close()


def run_phase_in_child(spec: MemorySpec, model: str, gpu: int, batch: int, width: int, height: int,
                       requests: int, concurrent: int = 1, execution: Optional[dict] = None) -> PhaseResult:
    """Run one measured load in a fresh process, so its memory policy applies before TensorFlow starts."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_phase_process, args=(send, str(spec), model, gpu, batch, width, height,
                                                           requests, concurrent, execution),
                                      name=f"calibrate-{spec}")
    process.start()
    send.close()
    try:
        kind, payload = receive.recv()
    except EOFError:
        process.join()
        raise CalibrationError(f"the {spec} run died with exit status {process.exitcode}") from None
    process.join()
    if kind == "error":
        raise CalibrationError(payload)
    payload["samples"] = [Sample(**s) for s in payload["samples"]]
    return PhaseResult(**payload)


@dataclass
class Calibration:
    """Both runs and the recommendation made from them."""

    growth: PhaseResult
    capped: Optional[PhaseResult]
    recommendation: Recommendation


def calibrate(model: str, gpu: int, batch: int, width: int, height: int, requests: int,
              headroom_percent: float = 20.0,
              run_phase: Callable[..., PhaseResult] = run_phase_in_child, concurrent: int = 1,
              execution: Optional[dict] = None) -> Calibration:
    """Run the growth load, recommend a cap, then run under the cap to measure the overhead.

    `execution` (asked, gate, threshold) settles the precision both runs compute at, as the model's worker would.
    """
    growth = run_phase(MemorySpec(mode="growth"), model, gpu, batch, width, height, requests, concurrent, execution)
    if growth.error is not None:
        raise CalibrationError(f"the load failed with memory growth: {growth.error}")
    if growth.tf_peak_mib is None:
        raise CalibrationError("TensorFlow reported no memory figures for the GPU")
    cap = recommend_cap(growth.tf_peak_mib, headroom_percent)
    capped = run_phase(MemorySpec(mode="cap", cap_mib=cap), model, gpu, growth.batch, growth.width, growth.height,
                       requests, concurrent, execution)
    overhead = measured_overhead(capped, cap) if capped.error is None else None
    return Calibration(growth, capped, Recommendation(cap, growth.tf_peak_mib, headroom_percent, overhead))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app calibrate",
        description="Measure a model's GPU memory under a synthetic load and recommend a cap (needs a GPU).",
    )
    parser.add_argument("--model", help="model base path or version folder, as DETECT_MODEL (or --group)")
    parser.add_argument("--group", metavar="NAME", help="a worker group: its cap from all its members' peaks")
    parser.add_argument("--max-batch", type=_positive, default=None, metavar="N",
                        help="images per model call (default: the max_batch_size setting, within the model's "
                             "batch dimension)")
    parser.add_argument("--image-size", type=_image_size, default=None, metavar="WxH",
                        help="synthetic image size (default: the largest max_image_pixels admits, square)")
    parser.add_argument("--requests", type=_positive, default=20, metavar="K", help="model calls per run (20)")
    parser.add_argument("--concurrent", type=_positive, default=None, metavar="N",
                        help="calls in flight at once (default: the inference_threads setting)")
    parser.add_argument("--headroom", type=float, default=20.0, metavar="PERCENT",
                        help="added to TensorFlow's peak for the cap (20)")
    parser.add_argument("--gpu", type=int, default=0, metavar="INDEX", help="GPU to measure on, nvidia-smi's index (0)")
    parser.add_argument("--write", type=Path, default=None, metavar="FILE",
                        help="put the cap in a settings file (gpu_memory), or in a fleet file (the instance of "
                             "this model's gpu_memory, and gpu_overhead_mib)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="memory over time (default: runs/calibrate/<model>-<version>.png)")
    parser.add_argument("--config", type=Path, default=None,
                        help="serve settings the defaults come from (default: config/default.toml if present)")
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, not {text!r}")
    return value


def _image_size(text: str) -> tuple[int, int]:
    found = _SIZE.match(text)
    if not found or int(found.group(1)) <= 0 or int(found.group(2)) <= 0:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 1920x1080, not {text!r}")
    return int(found.group(1)), int(found.group(2))


def main(argv: list[str], run_phase: Callable[..., PhaseResult] = run_phase_in_child, nvml_library=None) -> int:
    """Parse flags, check for a GPU, run both loads, and report; return the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ..models.repository import resolve_model
    from ..gpu.nvml import Nvml
    from ..settings import load_settings

    if bool(args.model) == bool(args.group):
        print("error: give --model or --group, not both", file=sys.stderr)
        return 2
    try:
        settings = load_settings(config_path=args.config)
        if args.group:
            return _main_group(args, settings, run_phase, nvml_library)
        version = resolve_model(args.model)
        if args.plot is not None:
            require_extra("tools", "matplotlib", "--plot")  # asked for: say so before the measurement, not after
    except (ConfigError, ModelError, MissingExtra) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if not 0 <= args.headroom <= 1000:
        print(f"error: --headroom {args.headroom:g} is not a percentage from 0 to 1000", file=sys.stderr)
        return 2
    try:  # say so before anything slow: no GPU here, nothing to measure
        Nvml.open(nvml_library).close()
    except NvmlUnavailable as exc:
        print(f"error: {NEEDS_GPU} (with its NVIDIA driver) to measure GPU memory, and this host has none: "
              f"{exc.message}. Run it on a machine with the GPU the instances will share.", file=sys.stderr)
        return 2
    own = settings.for_model(version.name)  # its [models.<name>] table, if the config file has one
    batch = args.max_batch or own.max_batch_size
    concurrent = args.concurrent or own.inference_threads
    side = math.isqrt(settings.max_image_pixels)
    width, height = args.image_size or (side, side)
    execution = {"asked": own.precision, "gate": own.parity_gate, "threshold": settings.default_threshold,
                 "max_pixels": settings.max_image_pixels}
    print(f"calibrating {args.model} ({version.name} version {version.version}) on GPU {args.gpu}: "
          f"{args.requests} calls of up to {batch} image(s) of {width}x{height}, {concurrent} at once, "
          f"precision {own.precision}", flush=True)
    try:
        result = calibrate(args.model, args.gpu, batch, width, height, args.requests, args.headroom, run_phase,
                           concurrent, execution)
    except CalibrationError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2 if exc.message.startswith(NEEDS_GPU) else 1
    print(report(result))
    plot_path = args.plot or Path("runs") / "calibrate" / f"{version.name}-{version.version}.png"
    try:
        require_extra("tools", "matplotlib", "the plot")
    except MissingExtra as exc:  # not a serving dependency: an image without it still calibrates
        print(f"plot: skipped; {exc.message}")
    else:
        save_plot(result, plot_path, f"{version.name} version {version.version}")
        print(f"plot: {plot_path}")
    if result.capped is not None and result.capped.error is not None:
        print(f"error: under the recommended cap the load failed: {result.capped.error}; "
              "try more --headroom", file=sys.stderr)
        return 1
    if args.write is not None:
        try:
            print(write_config(args.write, result.recommendation, args.model))
        except ConfigError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return 2
    return 0


def _main_group(args, settings, run_phase: Callable[..., PhaseResult], nvml_library) -> int:
    """Calibrate a worker group: each member's growth peak, summed, plus headroom; write [groups.<name>]."""
    from ..gpu.nvml import Nvml
    from .calibrate_group import GROWTH, calibrate_group, group_members, report_group, write_group_cap

    members = group_members(settings, args.group)  # ConfigError: exit 2 by the caller
    try:
        Nvml.open(nvml_library).close()
    except NvmlUnavailable as exc:
        print(f"error: {NEEDS_GPU} (with its NVIDIA driver), and this host has none: {exc.message}", file=sys.stderr)
        return 2
    side = math.isqrt(settings.max_image_pixels)
    width, height = args.image_size or (side, side)

    def growth(name: str, path: Path) -> float:
        own = settings.for_model(name)
        execution = {"asked": own.precision, "gate": own.parity_gate, "threshold": settings.default_threshold,
                     "max_pixels": settings.max_image_pixels}
        result = run_phase(GROWTH, str(path), args.gpu, args.max_batch or own.max_batch_size, width, height,
                           args.requests, args.concurrent or own.inference_threads, execution)
        if result.error is not None or result.tf_peak_mib is None:
            raise CalibrationError(f"member {name}: {result.error or 'TensorFlow reported no memory figures'}")
        return result.tf_peak_mib

    try:
        cap, peaks = calibrate_group(members, growth, args.headroom)
    except CalibrationError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    print(report_group(args.group, cap, peaks, args.headroom))
    if args.write is not None:
        print(write_group_cap(args.write, args.group, cap, sum(peaks.values()), args.headroom))
    return 0


def report(result: Calibration) -> str:
    """Describe both runs and the recommendation, one fact a line."""
    growth, capped, rec = result.growth, result.capped, result.recommendation
    lines = [
        f"load: {growth.requests} call(s) of {growth.batch} x {growth.width}x{growth.height}, "
        f"{growth.concurrent} at once, on {growth.gpu_name or 'the GPU'} in {growth.seconds:g} s (memory growth)",
        f"precision: {growth.precision} ({growth.precision_reason}); a cap measured at one precision does not hold "
        "at another",
        f"TensorFlow peak: {rec.tf_peak_mib:.1f} MiB; the process held {_mib(growth.nvml_peak_mib)} in NVML's view "
        "(growth never gives memory back)",
        f"recommended cap: {rec.cap_mib} MiB (peak + {rec.headroom_percent:g}%)",
    ]
    if capped is not None and capped.error is None:
        lines.append(f"under the cap: {capped.requests} call(s) fit; the process used {_mib(capped.nvml_peak_mib)}")
    if capped is not None and capped.precision != growth.precision:
        lines.append(f"warning: the capped run computed in {capped.precision}, not {growth.precision} "
                     f"({capped.precision_reason}); its figures are not the growth run's, calibrate again")
    if rec.overhead_mib is not None:
        lines.append(f"per-process overhead beyond the cap: {rec.overhead_mib} MiB "
                     "(CUDA context, cuDNN/cuBLAS workspaces; the fleet's gpu_overhead_mib)")
    else:
        lines.append("per-process overhead: not measured (NVML never showed the process above its cap)")
    if not growth.pid_visible or (capped is not None and not capped.pid_visible):
        lines.append("note: NVML did not show this process's pid (a container without --pid=host?); its figures "
                     "are the GPU's used memory change since the run began, other processes included")
    return "\n".join(lines)


def _mib(value: Optional[float]) -> str:
    return "? MiB" if value is None else f"{value:.0f} MiB"


def save_plot(result: Calibration, path: Path, title: str) -> None:
    """Save memory over time for both runs, with the recommended cap as a line (needs the `tools` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("memory growth", result.growth)] + ([(f"cap {result.recommendation.cap_mib} MiB", result.capped)]
                                                 if result.capped is not None else [])
    figure, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), sharey=True, squeeze=False)
    for axis, (label, run) in zip(axes[0], runs):
        times = [s.t_s for s in run.samples]
        for key, name in (("nvml_used_mib", "process, NVML"), ("tf_current_mib", "TensorFlow current"),
                          ("tf_peak_mib", "TensorFlow peak")):
            values = [getattr(s, key) for s in run.samples]
            if any(v is not None for v in values):
                axis.plot(times, [math.nan if v is None else v for v in values], label=name)
        axis.axhline(result.recommendation.cap_mib, color="red", linestyle="--",
                     label=f"recommended cap {result.recommendation.cap_mib} MiB")
        if result.recommendation.overhead_mib is not None:
            axis.axhline(result.recommendation.cap_mib + result.recommendation.overhead_mib, color="grey",
                         linestyle=":", label="cap + overhead")
        axis.set_title(f"{title}: {label}")
        axis.set_xlabel("seconds")
        axis.set_ylabel("MiB")
        axis.legend(loc="best", fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_config(path: Path, rec: Recommendation, model: str) -> str:
    """Put the recommendation in a settings file (the model's [models.<name>] table) or a fleet file.

    The file is created if missing; return what was written.
    """
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not TOML ({exc}); nothing was written") from None
    cap = f'gpu_memory = "{rec.cap_mib}MiB"  # calibrated: TensorFlow peak {rec.tf_peak_mib:.0f} MiB + ' \
          f'{rec.headroom_percent:g}%'
    if "instance" in data:
        text = _write_fleet(path, text, data, cap, rec, model)
        from .plan import parse_fleet

        parse_fleet(tomllib.loads(text), path)
        written = f"wrote {path}: gpu_memory {rec.cap_mib}MiB for {model}" + (
            f", gpu_overhead_mib {rec.overhead_mib}" if rec.overhead_mib is not None else "")
    else:
        from ..models.repository import resolve_model

        name = resolve_model(model).name
        text = _write_settings(text, cap, rec, name)
        written = f"wrote {path}: [models.{name}] gpu_memory {rec.cap_mib}MiB" + (
            f", gpu_overhead_mib {rec.overhead_mib}" if rec.overhead_mib is not None else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return written


def _write_settings(text: str, cap: str, rec: Recommendation, name: str) -> str:
    """Set the model's own table's gpu_memory, and the top-level gpu_overhead_mib, in a settings file's text."""
    lines = text.splitlines()
    first_table = next((i for i, line in enumerate(lines) if re.match(r"\s*\[", line)), len(lines))
    if rec.overhead_mib is not None:
        overhead = f"gpu_overhead_mib = {rec.overhead_mib}  # calibrated: NVML used beyond the cap"
        found = [i for i in range(first_table) if re.match(r"\s*gpu_overhead_mib\s*=", lines[i])]
        if found:
            lines[found[0]] = overhead
        else:
            lines.insert(first_table, overhead)
    from .calibrate_group import set_gpu_memory

    return set_gpu_memory(lines, "models", name, cap)


def _write_fleet(path: Path, text: str, data: dict, cap: str, rec: Recommendation, model: str) -> str:
    """Set the instance of `model`'s gpu_memory, and the top-level gpu_overhead_mib, in a fleet file's text."""
    wanted = Path(model).resolve()
    numbers = [i for i, table in enumerate(data["instance"])
               if isinstance(table, dict) and Path(str(table.get("model", ""))).resolve() == wanted]
    if not numbers:
        raise ConfigError(f"fleet file {path} has no instance with model {model}; nothing was written")
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"\s*\[\[\s*instance\s*\]\]", line)]
    for number in sorted(numbers, reverse=True):
        begin = starts[number]
        end = next((i for i in range(begin + 1, len(lines)) if re.match(r"\s*\[", lines[i])), len(lines))
        body = [line for line in lines[begin + 1:end] if not re.match(r"\s*gpu_memory\s*=", line)]
        after = next((i + 1 for i, line in enumerate(body) if re.match(r"\s*model\s*=", line)), 0)
        lines[begin + 1:end] = body[:after] + [cap] + body[after:]
    if rec.overhead_mib is not None:
        head = starts[0] if starts else len(lines)
        overhead = f"gpu_overhead_mib = {rec.overhead_mib}  # calibrated: NVML used beyond the cap"
        found = [i for i in range(head) if re.match(r"\s*gpu_overhead_mib\s*=", lines[i])]
        if found:
            lines[found[0]] = overhead
        else:
            lines.insert(head, overhead)
    return "\n".join(lines) + "\n"
