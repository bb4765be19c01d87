"""Find models and their versions on disk, in TF Serving's layout: `<repository>/<name>/<version>/saved_model.pb`.

A repository folder holds one subfolder per model; each model folder holds numbered versions, and
the highest is the one to serve (TF Serving's default version policy). A model may also be given
alone, as its base folder or as one version folder (then that version is served, and no other).
Nothing here imports TensorFlow, and nothing here writes to a model folder.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import ModelError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelVersion:
    """One servable version of a model."""

    name: str
    version: str
    path: Path


def _numbered_versions(base: Path) -> list[Path]:
    try:
        children = list(base.iterdir())
    except OSError:
        return []
    return sorted(
        (child for child in children
         if child.is_dir() and child.name.isdigit() and (child / "saved_model.pb").is_file()),
        key=lambda child: int(child.name),
    )


def resolve_model(path: str | Path) -> ModelVersion:
    """Resolve a base path to its highest numeric version, or accept a version folder as is.

    Raise ModelError naming the path and what is wrong: missing, not a folder, or no version in it.
    """
    path = Path(path)
    if not path.exists():
        raise ModelError(f"model path {path} does not exist")
    if not path.is_dir():
        raise ModelError(f"model path {path} is not a folder")
    if (path / "saved_model.pb").is_file():
        resolved = path.resolve()
        return ModelVersion(name=resolved.parent.name, version=resolved.name, path=path)
    versions = _numbered_versions(path)
    if not versions:
        raise ModelError(
            f"model path {path} holds no version: expected {path}/<number>/saved_model.pb "
            "or a saved_model.pb in the folder itself"
        )
    return ModelVersion(name=path.resolve().name, version=versions[-1].name, path=versions[-1])


@dataclass(frozen=True)
class ModelSource:
    """Where one model's versions come from: a base folder of numbered versions, or one pinned version."""

    name: str
    base: Path
    pinned: Optional[Path] = None  # a version folder given directly: it is served, and no other

    def versions(self) -> list[ModelVersion]:
        """Return the versions on disk, lowest first."""
        if self.pinned is not None:
            return [ModelVersion(self.name, self.pinned.resolve().name, self.pinned)]
        return [ModelVersion(self.name, child.name, child) for child in _numbered_versions(self.base)]

    def latest(self) -> Optional[ModelVersion]:
        """Return the version to serve: the highest on disk, or None if there is none now."""
        versions = self.versions()
        return versions[-1] if versions else None


def fingerprint(path: Path) -> tuple:
    """Return what identifies a version folder's contents: every file's relative path, size and mtime.

    A folder still being copied changes between two reads; a corrupt version is not tried again until
    its fingerprint changes.
    """
    entries = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            try:
                stat = os.stat(full)
            except OSError:
                continue
            entries.append((os.path.relpath(full, path), stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


class ModelRepository:
    """The models a server may serve, by name; read-only, safe to share between threads."""

    def __init__(self, sources: dict[str, ModelSource], root: Optional[Path] = None):
        self._sources = dict(sources)
        self.root = root  # the repository folder, if the models came from one

    @classmethod
    def open(cls, repository: str, model: str = "") -> "ModelRepository":
        """Open the models to serve: `model` alone if it is set, else every model in `repository`.

        Raise ModelError naming the path and what is wrong: missing, not a folder, or no model in it.
        """
        if model:
            found = resolve_model(model)  # raises with the path and what is wrong
            path = Path(model)
            pinned = path if (path / "saved_model.pb").is_file() else None
            base = path.resolve().parent if pinned is not None else path
            return cls({found.name: ModelSource(found.name, base, pinned)})
        root = Path(repository)
        if not root.is_dir():
            raise ModelError(f"model repository {root} {'is not a folder' if root.exists() else 'does not exist'}")
        sources = {}
        for child in sorted(root.iterdir()):
            if not child.is_dir() or child.name.startswith("."):
                continue
            if _numbered_versions(child):
                sources[child.name] = ModelSource(child.name, child)
            else:
                log.warning("model repository %s: %s holds no version (<number>/saved_model.pb); not a model",
                            root, child.name)
        if not sources:
            raise ModelError(f"model repository {root} holds no model: expected {root}/<name>/<number>/saved_model.pb")
        return cls(sources, root)

    def names(self) -> list[str]:
        return sorted(self._sources)

    def get(self, name: str) -> Optional[ModelSource]:
        return self._sources.get(name)
