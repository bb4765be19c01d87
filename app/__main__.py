"""Command line: `python -m app <command> [flags]`; each command parses its own flags."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .errors import MissingExtra

# name: (module, entry point, flag parser builder, one-line help)
COMMANDS = {
    "serve": ("app.hosting.serve", "main", "build_parser", "serve the models over HTTP"),
    "fleet": ("app.fleet.cli", "main", "build_parser", "run several instances on one GPU inside a memory budget"),
    "calibrate": ("app.fleet.calibrate", "main", "build_parser", "measure a model's GPU memory and recommend a cap"),
    "train": ("app.training.cli", "train_main", "train_parser",
              "train the shapes detector under the GPU memory policy"),
    "export": ("app.training.cli", "export_main", "export_parser", "export the trained shapes detector as a SavedModel"),
    "evaluate": ("app.training.cli", "evaluate_main", "evaluate_parser",
                 "compute COCO mAP of a detector on held-out shapes"),
}


def usage() -> str:
    """Return the top-level help: the commands and what each does."""
    lines = [f"  {name:<10} {help}" for name, (_, _, _, help) in COMMANDS.items()]
    return ("usage: python -m app [--version] <command> [flags]\n\n"
            "An object-detection HTTP service that shares one GPU with other TensorFlow processes.\n\n"
            "commands:\n" + "\n".join(lines) + "\n\n"
            "options:\n  -h, --help  show this help and exit\n  --version   print the version and exit\n\n"
            "`python -m app <command> --help` lists a command's flags.")


def parser_of(command: str) -> argparse.ArgumentParser:
    """Return a command's flag parser (for --help and the CLI reference); imports no TensorFlow."""
    module, _, builder, _ = COMMANDS[command]
    return getattr(importlib.import_module(module), builder)()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and argv[0] in ("-V", "--version"):
        print(f"gpu-share-detect {__version__}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        if argv:
            print(f"error: unknown command {argv[0]!r}", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    module, function, _, _ = COMMANDS[argv[0]]
    try:
        return getattr(importlib.import_module(module), function)(argv[1:])
    except MissingExtra as exc:  # one line naming the extra, not a traceback
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
