"""The fleet's state file: which instance runs as which pid, under which caps.

The fleet writes it (atomically: a temporary file in the same folder, then a rename) whenever an
instance starts, turns ready, exits or is restarted, and hands its path to every instance as
DETECT_FLEET_STATE. An instance's /gpu reads it to tell which process on the GPU is which instance.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

VERSION = 1
OTHER = "other"  # how /gpu names a process on the GPU that belongs to no instance


@dataclass(frozen=True)
class InstanceState:
    """One instance as the fleet last saw it."""

    name: str
    port: int
    model: str
    gpu_memory: str  # the policy as given, e.g. "4096MiB", "25%", "growth"
    caps_mib: dict[int, Optional[int]]  # per GPU index; None: no cap (growth, greedy)
    pid: Optional[int] = None  # None while it is not running
    state: str = "starting"  # starting | ready | restarting | failed | stopping | stopped
    restarts: int = 0

    def to_json(self) -> dict:
        return {
            "name": self.name, "port": self.port, "model": self.model, "gpu_memory": self.gpu_memory,
            "caps_mib": {str(k): v for k, v in self.caps_mib.items()}, "pid": self.pid, "state": self.state,
            "restarts": self.restarts,
        }


@dataclass(frozen=True)
class FleetState:
    """The whole fleet: its own pid, the overhead it budgets per process, and its instances."""

    fleet_pid: int
    gpu_overhead_mib: int
    instances: tuple[InstanceState, ...]
    updated_unix: float = field(default_factory=time.time)

    def by_pid(self) -> dict[int, InstanceState]:
        return {i.pid: i for i in self.instances if i.pid is not None}

    def named(self, name: str) -> Optional[InstanceState]:
        return next((i for i in self.instances if i.name == name), None)

    def to_json(self) -> dict:
        return {
            "version": VERSION, "fleet_pid": self.fleet_pid, "updated_unix": round(self.updated_unix, 3),
            "gpu_overhead_mib": self.gpu_overhead_mib, "instances": [i.to_json() for i in self.instances],
        }


def write_state(path: Path, state: FleetState) -> None:
    """Replace the state file in one step, so a reader never sees half of it."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(state.to_json(), out, indent=1)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_state(path: Path) -> FleetState:
    """Read a state file; raise OSError if it cannot be read, ValueError if it is not one."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ValueError(f"{path} is not a version {VERSION} fleet state file")
    try:
        instances = tuple(
            InstanceState(
                name=str(i["name"]), port=int(i["port"]), model=str(i["model"]), gpu_memory=str(i["gpu_memory"]),
                caps_mib={int(k): (None if v is None else int(v)) for k, v in i["caps_mib"].items()},
                pid=None if i["pid"] is None else int(i["pid"]), state=str(i["state"]), restarts=int(i["restarts"]),
            )
            for i in data["instances"]
        )
        return FleetState(fleet_pid=int(data["fleet_pid"]), gpu_overhead_mib=int(data["gpu_overhead_mib"]),
                          instances=instances, updated_unix=float(data["updated_unix"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path} is a malformed fleet state file ({type(exc).__name__}: {exc})") from None
