"""Every repository path that a docstring, a comment or a documentation page names exists.

A path is `app/...py`, `tools/...py`, or anything under `scripts/` or `benchmarks/`, written as it is from the
repository's root. Python files are read for their docstrings and comments only (a path a program builds at
run time is its own business); the pages are read whole, code blocks included, since a reader copies them.
A folder .gitignore names (made at run time, such as benchmarks/peers/.venvs) counts as there.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from conftest import ROOT

PYTHON_FOLDERS = ("app", "tools", "benchmarks", "tests")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Not preceded by what would make it part of a longer path (/work/main/app/..., site-packages/app/...) or a word.
PATH = re.compile(r"(?<![\w./-])(?:(?:app|tools)/[\w/]+\.py\b|(?:scripts|benchmarks)/[\w./-]*[\w/])")


def named_paths(text: str) -> set[str]:
    """Return the repository paths in a piece of prose or code."""
    return {match.rstrip("/") for match in PATH.findall(text)}


def python_prose(source: str) -> str:
    """Return a Python file's docstrings and comments, one after another."""
    parts = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            parts.append(ast.get_docstring(node, clean=False) or "")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            parts.append(token.string)
    return "\n".join(parts)


def sources() -> list[Path]:
    return sorted(path for folder in PYTHON_FOLDERS for path in (ROOT / folder).rglob("*.py")
                  if not any(part.startswith(".") or part == "node_modules" for part in path.relative_to(ROOT).parts))


def ignored_folders() -> set[str]:
    """The plain folder paths .gitignore names (no pattern characters), without their slashes."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return {line.strip("/") for line in lines if "/" in line.strip("/") and not re.search(r"[*?\[!#]", line)}


def exists(name: str) -> bool:
    return (ROOT / name).exists() or any(name == folder or name.startswith(folder + "/") for folder in IGNORED)


IGNORED = ignored_folders()


def missing_in(path: Path, text: str) -> list[str]:
    where = path.relative_to(ROOT)
    return [f"{where}: {name}" for name in sorted(named_paths(text)) if not exists(name)]


def test_every_path_named_in_a_docstring_or_comment_exists():
    missing = [line for path in sources() for line in missing_in(path, python_prose(path.read_text()))]
    assert missing == [], "named but not in the repository:\n" + "\n".join(missing)


def test_every_path_named_in_the_documentation_exists():
    missing = [line for path in PAGES for line in missing_in(path, path.read_text())]
    assert missing == [], "named but not in the repository:\n" + "\n".join(missing)


@pytest.mark.parametrize("text, found", [
    ("see app/gpu/nvml.py and tools/bench.py.", {"app/gpu/nvml.py", "tools/bench.py"}),
    ("`scripts/gpu-check --out DIR`, scripts/_venv.sh:", {"scripts/gpu-check", "scripts/_venv.sh"}),
    ("benchmarks/peers/<peer>/requirements.txt", {"benchmarks/peers"}),
    ("/work/main/app/x.py, site-packages/tools/y.py, https://h/scripts/z", set()),
    ("app.http.openapi, app/, tools/*.py, out/scripts", set()),
])
def test_what_counts_as_a_named_path(text, found):
    assert named_paths(text) == found


def test_a_path_that_is_gone_is_reported(tmp_path):
    """The check can fail: a comment naming a file that does not exist is listed with where it was found."""
    source = '"""Runs scripts/gpu_check.py."""\n# see app/nvml.py\nx = "app/not_prose.py"\n'
    assert sorted(named_paths(python_prose(source))) == ["app/nvml.py", "scripts/gpu_check.py"]
    assert missing_in(ROOT / "tools" / "x.py", python_prose(source)) == [
        "tools/x.py: app/nvml.py", "tools/x.py: scripts/gpu_check.py"]


def test_a_folder_made_at_run_time_counts_only_where_gitignore_names_it():
    assert "benchmarks/peers/.venvs" in IGNORED and exists("benchmarks/peers/.venvs/ray")
    assert not exists("benchmarks/peers/.venv") and not exists("scripts/.venvs")
