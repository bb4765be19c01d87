"""TF Serving's API (predict, model status, model metadata): the logic its REST and gRPC forms share.

HTTP (app/http/v1.py) reads a JSON body (app/protocol/v1_codec.py) and gRPC (app/grpc/tfserving.py) a
PredictRequest's TensorProto; both hand `predict` a reader that turns the request's input into images
once the model's signature is known, and write the stacked outputs in their own format. Model status
is written once, in TF Serving's ModelVersionStatus terms.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Optional

import numpy as np

from ..errors import VersionNotFound
from ..inference.detections import stack_outputs
from ..inference.images import DecodedImage
from .plane import DataPlane, Run

# The registry's model states as TF Serving's ModelVersionStatus names them.
STATES = {"loading": "LOADING", "ready": "AVAILABLE", "unloading": "UNLOADING", "failed": "END"}

ImageReader = Callable[[dict], Callable[[], list[DecodedImage]]]  # signature -> what decodes the images


def predict(plane: DataPlane, model, deadline: float, read_images: ImageReader,
            admit: Callable[[object], AbstractContextManager] = lambda model: nullcontext(),
            ) -> tuple[Run, dict[str, np.ndarray], list[str]]:
    """Run one predict request on `model`: its signature, its images (`read_images(signature)` checks the
    request's input and returns what decodes it), the run; return the run, the stacked outputs and the
    signature's output names. `admit(model)` is the front door's own admission around the model's work."""
    with admit(model):
        signature = plane.signature_of(model, deadline)
        prepare = read_images(signature)
        run = plane.run_images(model, prepare, deadline)
    return run, stack_outputs(run.outputs), [out["name"] for out in signature["outputs"]]


def model_statuses(plane: DataPlane, name: str, version: Optional[str], shown_version: str) -> list[dict]:
    """The model_version_status list of model `name`, which the caller has found (each door in its own order of
    checks), of one version if `version` is given (VersionNotFound for a version not loading, served or failed;
    `shown_version` is how the message names it)."""
    statuses = version_statuses(plane.models.describe([name])[0])
    if version is not None:
        statuses = [s for s in statuses if s["version"] == version]
        if not statuses:
            raise VersionNotFound(f"model {name} has no version {shown_version} that is loading, served or failed")
    return statuses


def version_statuses(described: dict) -> list[dict]:
    """The model_version_status list from a model's description (GET /models/<name>'s), newest version first.

    Versions loading, served or failed are listed as TF Serving lists them. A model with none of those (not
    loaded yet, or unloaded when idle) lists the version it would load as START, since its next request loads
    it; one unloaded by request lists it as END.
    """
    statuses = []
    for entry in sorted(described["versions"], key=lambda v: int(v["version"]), reverse=True):
        state = STATES.get(entry["state"])
        if state is None:
            continue
        error = entry.get("reason") or (described["reason"] if entry["state"] == "failed" else None)
        statuses.append(_status(entry["version"], state, error))
    if not statuses and described["versions"]:
        latest = max(described["versions"], key=lambda v: int(v["version"]))["version"]
        statuses.append(_status(latest, "END" if described["unloaded_by_request"] else "START", None))
    return statuses


def _status(version: str, state: str, error: Optional[str]) -> dict:
    return {"version": version, "state": state,
            "status": {"error_code": "UNKNOWN" if error else "OK", "error_message": error or ""}}
