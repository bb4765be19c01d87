"""Build the /gpu report: what NVML sees of the server's GPUs, and whose memory each process holds.

Its `accounting` names every compute process on those GPUs: one of this server's model workers (by
model and version), a worker of another fleet instance (matched through its parent, the instance's
pid in the fleet's state file), or `other`; with NVML's used MiB, its cap, and the overhead beyond the
cap (CUDA context, cuDNN/cuBLAS workspaces). For each of this server's workers it also gives what
TensorFlow holds but does not use: NVML used - TensorFlow's current - the overhead, the memory that
growth never gives back. Where NVML cannot see a worker's pid (a container without --pid=host sees
host pids), it says so and falls back to the worker's own TensorFlow figures.

This runs in the HTTP process, which never imports TensorFlow: TensorFlow's figures come from the
workers, on their control channel.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..errors import NvmlUnavailable
from ..fleet.state import OTHER, FleetState, read_state
from .nvml import DeviceSnapshot, Nvml

_LOGICAL_INDEX = re.compile(r"GPU:(\d+)$")
PID_NOT_VISIBLE = (
    "worker pid {pid} is not among NVML's compute processes on its GPUs: in a container NVML reports host pids "
    "unless the container runs with --pid=host (or the worker holds no GPU memory yet); the figures are "
    "TensorFlow's own"
)


def parent_pid(pid: int) -> Optional[int]:
    """Return a process's parent pid from /proc, or None if it is not visible here."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class GpuReport:
    """Report GPU state on demand; called from WSGI threads, thread-safe (it keeps no mutable state).

    `workers()` returns this server's model workers as dicts: pid, model, version, caps_mib {index: MiB},
    policy (as the worker applied it) and tensorflow (its allocator figures, [] without a GPU).
    """

    def __init__(self, nvml: Optional[Nvml], nvml_reason: Optional[str] = None,
                 selected: Optional[Sequence[int]] = None, workers: Callable[[], list[dict]] = list,
                 overhead_mib: int = 1024, fleet_state: Optional[str | Path] = None, instance_name: str = "",
                 pid: Optional[int] = None, parent_of: Callable[[int], Optional[int]] = parent_pid,
                 groups: Callable[[], list[dict]] = list):
        self.nvml = nvml
        self.nvml_reason = nvml_reason
        self.selected = None if selected is None else tuple(selected)
        self._workers = workers
        self.overhead_mib = overhead_mib
        self._pid = os.getpid() if pid is None else pid
        self._fleet_state = Path(fleet_state) if fleet_state else None  # the fleet rewrites it; read per report
        self._instance_name = instance_name or None
        self._parent_of = parent_of
        self._groups = groups  # the worker groups: members, the one worker's pid, its cap, its one overhead

    def devices(self) -> list[DeviceSnapshot]:
        """Return NVML snapshots of the server's GPUs; raise NvmlUnavailable without NVML."""
        if self.nvml is None:
            raise NvmlUnavailable(self.nvml_reason or "NVML is unavailable")
        return self.nvml.snapshot(None if self.selected is None else list(self.selected))

    def to_json(self) -> dict:
        workers = self._workers()
        report: dict = {"pid": self._pid, "instance": self._instance_name,
                        "workers": [{k: w.get(k) for k in ("model", "version", "pid", "worker_group", "caps_mib",
                                                                   "policy")} for w in workers],
                        "groups": self._groups()}
        unavailable = self._unavailable_reason()
        devices: list[DeviceSnapshot] = []
        if unavailable is None:
            try:
                devices = self.devices()
                driver = self.nvml.driver_version()
                cuda = self.nvml.cuda_driver_version()
            except NvmlUnavailable as exc:
                unavailable, devices = exc.message, []
            if unavailable is None and not devices:
                unavailable = "NVML sees no GPU"
        report["accounting"] = self.accounting(devices, workers, unavailable)
        if unavailable is not None:
            return {"available": False, "reason": unavailable, **report}
        by_pid = _by_pid(workers)
        return {
            "available": True,
            "driver_version": driver,
            "cuda_driver_version": cuda,
            "devices": [
                {
                    "index": d.index,
                    "name": d.name,
                    "uuid": d.uuid,
                    "memory_mib": {
                        "total": d.memory_total_mib,
                        "used": d.memory_used_mib,
                        "free": d.memory_free_mib,
                        "reserved": d.memory_reserved_mib,
                    },
                    "utilization_percent": d.utilization_percent,
                    "processes": [
                        {"pid": p.pid, "used_mib": p.used_mib, "this_server": p.pid == self._pid or p.pid in by_pid,
                         "model": _model_text(by_pid.get(p.pid))}
                        for p in d.processes
                    ],
                }
                for d in devices
            ],
            **report,
        }

    def _unavailable_reason(self) -> Optional[str]:
        if self.nvml is None:
            return self.nvml_reason or "NVML is unavailable"
        if self.selected == ():
            return "no GPU selected (DETECT_GPUS=none)"
        return None

    def fleet(self) -> tuple[Optional[FleetState], Optional[str]]:
        """Read the fleet's state file; return it, or why it cannot be used."""
        if self._fleet_state is None:
            return None, None
        try:
            return read_state(self._fleet_state), None
        except (OSError, ValueError) as exc:
            return None, f"the fleet state file cannot be used: {exc}"

    def accounting(self, devices: Sequence[DeviceSnapshot], workers: list[dict],
                   unavailable: Optional[str] = None) -> dict:
        """Attribute each process on the GPUs to a worker or instance, and size what each worker holds unused."""
        fleet, fleet_note = self.fleet()
        instances = fleet.by_pid() if fleet is not None else {}
        by_pid = _by_pid(workers)
        gpus = []
        for device in devices:
            rows = []
            for process in device.processes:
                row = {"pid": process.pid, "owner": OTHER, "model": None, "version": None, "instance": None,
                       "this_server": False, "used_mib": process.used_mib, "cap_mib": None, "overhead_mib": None}
                worker = by_pid.get(process.pid)
                if worker is not None:
                    row.update(owner="worker", model=worker["model"], version=worker["version"],
                               instance=self._instance_name, this_server=True,
                               cap_mib=worker["caps_mib"].get(device.index))
                elif process.pid == self._pid:
                    row.update(owner="server", instance=self._instance_name, this_server=True)
                else:
                    instance = instances.get(process.pid) or instances.get(self._parent_of(process.pid))
                    if instance is not None and instance.name != self._instance_name:
                        row.update(owner="instance", instance=instance.name,
                                   cap_mib=instance.caps_mib.get(device.index))
                row["overhead_mib"] = _overhead(row["used_mib"], row["cap_mib"])
                rows.append(row)
            gpus.append({"index": device.index, "processes": rows})
        result = {
            "fleet": None if fleet is None else {
                "state_file": str(self._fleet_state), "fleet_pid": fleet.fleet_pid,
                "gpu_overhead_mib": fleet.gpu_overhead_mib, "instances": [i.name for i in fleet.instances],
                # What the page needs to link the other instances (on this host, so by port).
                "members": [{"name": i.name, "port": i.port, "model": i.model, "state": i.state,
                             "this_instance": i.name == self._instance_name} for i in fleet.instances],
            },
            "gpus": gpus,
            "workers": [self._worker_rows(w, devices, unavailable) for w in workers],
        }
        if fleet_note is not None:
            result["fleet_note"] = fleet_note
        return result

    def _worker_rows(self, worker: dict, devices: Sequence[DeviceSnapshot], unavailable: Optional[str]) -> dict:
        policy = worker.get("policy") or {}
        physical = [g["index"] for g in policy.get("gpus") or []]
        used = {d.index: p.used_mib for d in devices for p in d.processes if p.pid == worker["pid"]}
        visible = bool(used) if devices else None
        tf_by_index = _tf_by_physical(worker.get("tensorflow"), physical)
        rows = []
        for index in physical:
            tf = tf_by_index.get(index, {})
            current, cap = tf.get("current_mib"), worker["caps_mib"].get(index)
            row = {"index": index, "used_mib": None, "tf_current_mib": current, "tf_peak_mib": tf.get("peak_mib"),
                   "cap_mib": cap, "overhead_mib": None, "overhead_from": None, "held_unused_mib": None}
            if visible:
                nvml_used = used.get(index)
                row["used_mib"] = nvml_used
                measured = _overhead(nvml_used, cap)
                if measured is not None:  # a capped allocator maps its whole cap: the rest is overhead
                    row["overhead_mib"], row["overhead_from"] = measured, "NVML used - cap"
                else:
                    row["overhead_mib"], row["overhead_from"] = self.overhead_mib, "gpu_overhead_mib"
                if nvml_used is not None and current is not None:
                    row["held_unused_mib"] = round(nvml_used - current - row["overhead_mib"], 1)
            elif cap is not None and current is not None:
                row["held_unused_mib"] = round(cap - current, 1)  # TF's view: it maps its whole cap
            rows.append(row)
        if not physical:
            source, note = "tensorflow", policy.get("note") or "the worker's TensorFlow uses no GPU"
        elif visible:
            source, note = "nvml", None
        elif visible is False:
            source, note = "tensorflow", PID_NOT_VISIBLE.format(pid=worker["pid"])
        else:
            source, note = "tensorflow", f"NVML is unavailable ({unavailable}); the figures are TensorFlow's own"
        return {"model": worker["model"], "version": worker["version"], "pid": worker["pid"], "pid_visible": visible,
                "source": source, "note": note, "gpus": rows}


def _by_pid(workers: list[dict]) -> dict[int, dict]:
    """Each worker process's row by pid; a worker group's one process names all its members' models."""
    found: dict[int, dict] = {}
    for worker in workers:
        held = found.get(worker["pid"])
        if held is None:
            found[worker["pid"]] = dict(worker)
        else:
            held["model"] = f"{held['model']}, {worker['model']}"
    return found


def _model_text(worker: Optional[dict]) -> Optional[str]:
    if worker is not None and worker.get("worker_group"):
        return f"group {worker['worker_group']}: {worker['model']}"
    return None if worker is None else f"{worker['model']}/{worker['version']}"


def _overhead(used_mib: Optional[int], cap_mib: Optional[int]) -> Optional[int]:
    """Return NVML's used MiB beyond the cap; None where either is unknown or TF has not mapped its cap yet."""
    if used_mib is None or cap_mib is None or used_mib < cap_mib:
        return None
    return used_mib - cap_mib


def _tf_by_physical(tf_memory, physical: list[int]) -> dict[int, dict]:
    """Key TensorFlow's per-logical-GPU figures by physical index: logical GPU k is the k-th selected GPU."""
    if not isinstance(tf_memory, list):
        return {}
    figures = {}
    for entry in tf_memory:
        found = _LOGICAL_INDEX.search(str(entry.get("device", "")))
        if found and int(found.group(1)) < len(physical) and "error" not in entry:
            figures[physical[int(found.group(1))]] = entry
    return figures
