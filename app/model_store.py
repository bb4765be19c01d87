"""Find the model version to serve, following TF Serving's layout: `<base>/<version>/saved_model.pb`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError


@dataclass(frozen=True)
class ModelVersion:
    """One servable version of a model."""

    name: str
    version: str
    path: Path


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
    versions = [
        child for child in path.iterdir()
        if child.is_dir() and child.name.isdigit() and (child / "saved_model.pb").is_file()
    ]
    if not versions:
        raise ModelError(
            f"model path {path} holds no version: expected {path}/<number>/saved_model.pb "
            "or a saved_model.pb in the folder itself"
        )
    best = max(versions, key=lambda child: int(child.name))
    return ModelVersion(name=path.resolve().name, version=best.name, path=best)
