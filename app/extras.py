"""The install extras a command needs beyond serving (pyproject.toml), and the one line that names the missing one."""

from __future__ import annotations

import importlib

from .errors import MissingExtra


def require_extra(extra: str, module: str, needed_by: str) -> None:
    """Import `module` or raise MissingExtra saying which extra of the package to install for `needed_by`."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise MissingExtra(
            f"{needed_by} needs {module}, which the '{extra}' extra installs: pip install 'gpu-share-detect[{extra}]' "
            f"(in a clone: .venv/bin/pip install -e '.[{extra}]')") from None

