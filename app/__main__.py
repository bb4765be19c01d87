"""Command line: `python -m app <command> [flags]`; each command parses its own flags."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("app.hosting.serve", "main", "serve the models over HTTP"),
    "train": ("app.training.cli", "train_main", "train the shapes detector under the GPU memory policy"),
    "export": ("app.training.cli", "export_main", "export the trained shapes detector as a SavedModel"),
    "evaluate": ("app.training.cli", "evaluate_main", "compute COCO mAP of a detector on held-out shapes"),
    "fleet": ("app.fleet.cli", "main", "run several instances on one GPU inside a memory budget"),
    "calibrate": ("app.gpu.calibrate", "main", "measure a model's GPU memory and recommend a cap"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<10} {help}" for name, (_, _, help) in COMMANDS.items()]
        print("usage: python -m app <command> [flags]\n\ncommands:\n" + "\n".join(lines), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, function, _ = COMMANDS[argv[0]]
    return getattr(importlib.import_module(module), function)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
