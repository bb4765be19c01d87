"""`python -m app train|export|evaluate`: parse flags, apply the GPU memory policy, then run the command.

Each command builds Settings the way `serve` does (defaults <- TOML <- DETECT_* <- flags), so a
training run on a shared GPU obeys the same DETECT_GPU_MEMORY / DETECT_GPUS as the server, and
applies the policy before TensorFlow creates any tensor. A bad setting or a policy that cannot be
applied is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, ModelError, PolicyError
from ..extras import require_extra
from ..settings import env_name, load_settings

log = logging.getLogger("app.shapes")

DEFAULT_LOGDIR = Path("runs/shapes")
DEFAULT_MODELS = Path("models/shapes")
QUICK_STEPS = 3
QUICK_BATCH = 2


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m app {prog}", description=description)
    parser.add_argument("--config", type=Path, default=None,
                        help="TOML settings file (default: config/default.toml if present)")
    parser.add_argument("--gpu-memory", dest="gpu_memory", default=None, metavar="SPEC",
                        help=f"GPU memory policy: greedy, growth, 4GiB, 25%% [{env_name('gpu_memory')}]")
    parser.add_argument("--gpus", default=None, metavar="LIST",
                        help=f"physical GPUs to use: '' all, 'none', or '0,1' [{env_name('gpus')}]")
    return parser


def _with_gpu_policy(args: argparse.Namespace, command: Callable[[], int]) -> int:
    """Build settings, apply the memory policy, run `command`; map project errors to exit 2."""
    try:
        settings = load_settings(flags={"gpu_memory": args.gpu_memory, "gpus": args.gpus},
                                 config_path=args.config)
        logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from ..gpu.setup import setup_gpus

        setup_gpus(settings.gpu_memory, settings.gpus)  # before TensorFlow creates any tensor; logs the policy it applied
        return command()
    except (ConfigError, PolicyError, ModelError) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


def train_parser() -> argparse.ArgumentParser:
    """Return the `train` flag parser."""
    parser = _parser("train", "Train the shapes detector on generated scenes, under the GPU memory policy.")
    parser.add_argument("--steps", type=int, default=None, help="train up to this step (default 4000)")
    parser.add_argument("--batch-size", type=int, default=None, help="scenes per step (default 16)")
    parser.add_argument("--learning-rate", type=float, default=None, help="peak learning rate (default 2e-3)")
    parser.add_argument("--seed", type=int, default=0, help="training stream seed (default 0)")
    parser.add_argument("--logdir", type=Path, default=DEFAULT_LOGDIR,
                        help="TensorBoard logs and checkpoints/ (default runs/shapes)")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints (100)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: {QUICK_STEPS} steps of {QUICK_BATCH} scenes unless given")
    return parser


def train_main(argv: list[str]) -> int:
    """Train the shapes detector; resume from the latest checkpoint in --logdir."""
    parser = train_parser()
    args = parser.parse_args(argv)

    def command() -> int:
        from .train import TrainConfig, Trainer, describe

        defaults = TrainConfig()
        quick = args.quick
        config = TrainConfig(
            steps=_positive(args.steps, QUICK_STEPS if quick else defaults.steps, "--steps"),
            batch_size=_positive(args.batch_size, QUICK_BATCH if quick else defaults.batch_size, "--batch-size"),
            learning_rate=args.learning_rate or defaults.learning_rate,
            seed=args.seed,
            logdir=args.logdir,
            checkpoint_every=_positive(args.checkpoint_every, defaults.checkpoint_every, "--checkpoint-every"),
        )
        print(describe(config), file=sys.stderr)
        try:
            step = Trainer(config).run()
        except KeyboardInterrupt:
            return 130
        print(f"trained to step {step}; checkpoints in {config.checkpoint_dir}", file=sys.stderr)
        return 0

    return _with_gpu_policy(args, command)


def export_parser() -> argparse.ArgumentParser:
    """Return the `export` flag parser."""
    parser = _parser("export", "Export the trained shapes detector as an OD API SavedModel.")
    parser.add_argument("--checkpoint-dir", type=Path, default=DEFAULT_LOGDIR / "checkpoints",
                        help="where `train` wrote its checkpoints (default runs/shapes/checkpoints)")
    parser.add_argument("--out", type=Path, default=None,
                        help="version folder to write (default: the next version under models/shapes)")
    return parser


def export_main(argv: list[str]) -> int:
    """Export the latest checkpoint as a SavedModel version folder with its label map."""
    args = export_parser().parse_args(argv)

    def command() -> int:
        from .export import export, next_version

        out = args.out if args.out is not None else next_version(DEFAULT_MODELS)
        try:
            path = export(args.checkpoint_dir, out)
        except FileNotFoundError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except FileExistsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"exported {path}", file=sys.stderr)
        return 0

    return _with_gpu_policy(args, command)


def evaluate_parser() -> argparse.ArgumentParser:
    """Return the `evaluate` flag parser."""
    parser = _parser("evaluate", "Compute COCO mAP@0.5 and mAP@[0.5:0.95] on held-out generated scenes.")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODELS,
                        help="model base path (its highest version) or one version folder (default models/shapes)")
    parser.add_argument("--images", type=int, default=500, help="held-out scenes to score (default 500)")
    return parser


def evaluate_main(argv: list[str]) -> int:
    """Compute COCO mAP of a model on the held-out scenes; write metrics.json beside it."""
    args = evaluate_parser().parse_args(argv)
    require_extra("tools", "pycocotools", "python -m app evaluate")  # before minutes of inference, not after

    def command() -> int:
        from .evaluate import evaluate_model

        count = _positive(args.images, 500, "--images")
        metrics = evaluate_model(args.model, count)
        print(f"mAP@0.5 {metrics['map_50']:.4f}  mAP@[0.5:0.95] {metrics['map_50_95']:.4f}  "
              f"({metrics['images']} images); 640x480 in {metrics['latency_640x480_ms']['p50']:.1f} ms (p50); "
              f"{metrics['size_bytes'] / 1e6:.2f} MB -> {metrics['path']}", file=sys.stderr)
        return 0

    return _with_gpu_policy(args, command)


def _positive(value, default: int, flag: str) -> int:
    if value is None:
        return default
    if value < 1:
        raise ConfigError(f"{flag} must be at least 1, not {value}")
    return value
