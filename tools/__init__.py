"""The project's tools: benchmarks, soaks, the chaos run, the GPU check, the model exporters, the docs hooks.

Run from the repository's root as `python -m tools.NAME` (scripts/ holds the launchers). Not part of the
wheel: they import `app` from this checkout and nothing of theirs ships. Importing this package imports
nothing else: the GPU check runs on machines with only the standard library and pynvml.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository's root
