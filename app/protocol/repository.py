"""Triton's model-repository extension: the index and its states, load and unload, for both front doors.

HTTP's /v2/repository routes (app/http/models.py) and gRPC's RepositoryIndex, RepositoryModelLoad and
RepositoryModelUnload (app/grpc/kserve.py) call these, so tritonclient's get_model_repository_index,
load_model and unload_model see the same answers over either.
"""

from __future__ import annotations

from ..errors import BadRequest
from . import context
from .plane import DataPlane

# Triton's repository index states.
_INDEX_STATES = {"ready": "READY", "loading": "LOADING", "unloading": "UNLOADING", "unloaded": "UNAVAILABLE",
                 "failed": "UNAVAILABLE"}


def index_rows(plane: DataPlane, ready_only: bool) -> list[dict]:
    """The repository index, as Triton lists it: name, version, state, and the reason of one not ready."""
    rows = []
    for model in plane.models.describe():
        state = _INDEX_STATES[model["state"]]
        if ready_only and state != "READY":
            continue
        row = {"name": model["name"], "version": model["version"] or "", "state": state}
        reason = model["reason"] or ("unloaded by request" if model["unloaded_by_request"] else "")
        if state != "READY" and reason:
            row["reason"] = reason
        rows.append(row)
    return rows


def load(plane: DataPlane, name: str, parameters) -> None:
    """Load model `name` (its highest version), refusing Triton's load overrides; blocks until it is loaded."""
    check_load_parameters(parameters)
    context.name_model(name)
    plane.models.load(name)


def unload(plane: DataPlane, name: str) -> None:
    """Unload model `name` by request; blocks until it is unloaded."""
    context.name_model(name)
    plane.models.unload(name)


def check_load_parameters(parameters) -> None:
    """Refuse Triton's load overrides (a config, model files in the request): models load as they are on disk."""
    overrides = sorted(key for key in parameters if key == "config" or key.startswith("file:"))
    if overrides:
        raise BadRequest(f"loading with {', '.join(overrides)} is not supported: this server loads model folders "
                         "as they are on disk")
