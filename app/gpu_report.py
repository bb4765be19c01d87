"""Build the /gpu report: what NVML sees of this process's GPUs, the applied policy, TensorFlow's view.

Its `accounting` part names every compute process on this instance's GPUs: the fleet instance it
belongs to (matched by pid against the fleet's state file), NVML's used MiB, its cap, and the
overhead beyond the cap (CUDA context, cuDNN/cuBLAS workspaces). For this instance itself it gives
what TensorFlow holds but does not use: NVML used - TensorFlow's current - the overhead, the memory
that growth never gives back. Where NVML cannot see this process's pid (a container without
--pid=host sees host pids), it says so and falls back to TensorFlow's own figures.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Optional, Sequence

from .errors import NvmlUnavailable
from .fleet_state import OTHER, FleetState, read_state
from .gpu_setup import GpuSetup
from .memory_policy import tensorflow_memory_info
from .nvml import DeviceSnapshot

_LOGICAL_INDEX = re.compile(r"GPU:(\d+)$")
PID_NOT_VISIBLE = (
    "this process (pid {pid}) is not among NVML's compute processes on its GPUs: in a container NVML reports "
    "host pids unless the container runs with --pid=host (or this process holds no GPU memory yet); "
    "the figures are TensorFlow's own"
)


class GpuReport:
    """Report GPU state on demand; called from WSGI threads, thread-safe (it keeps no mutable state)."""

    def __init__(self, setup: GpuSetup, tf_memory: Callable[[], list[dict]] = tensorflow_memory_info,
                 pid: Optional[int] = None, fleet_state: Optional[str | Path] = None, instance_name: str = ""):
        self.setup = setup
        self._tf_memory = tf_memory
        self._pid = os.getpid() if pid is None else pid
        self._fleet_state = Path(fleet_state) if fleet_state else None  # the fleet rewrites it; read per report
        self._instance_name = instance_name or None

    def indices(self) -> Optional[list[int]]:
        """Return the physical GPUs this process may use (None: all that NVML sees)."""
        if self.setup.policy.gpus:
            return [g.index for g in self.setup.policy.gpus]
        selected = self.setup.selected
        return None if selected is None else list(selected)

    def devices(self):
        """Return NVML snapshots of this process's GPUs; raise NvmlUnavailable without NVML."""
        nvml = self.setup.nvml
        if nvml is None:
            raise NvmlUnavailable(self.setup.nvml_reason or "NVML is unavailable")
        return nvml.snapshot(self.indices())

    def to_json(self) -> dict:
        policy = self.setup.policy
        report: dict = {"policy": policy.to_json(), "pid": self._pid}
        try:
            report["tensorflow"] = self._tf_memory()
        except Exception as exc:  # TF's view is a bonus; never fail the report for it
            report["tensorflow"] = {"error": str(exc)}
        unavailable = self._unavailable_reason()
        devices: list[DeviceSnapshot] = []
        if unavailable is None:
            try:
                devices = self.devices()
                driver = self.setup.nvml.driver_version()
                cuda = self.setup.nvml.cuda_driver_version()
            except NvmlUnavailable as exc:
                unavailable, devices = exc.message, []
            if unavailable is None and not devices:
                unavailable = "NVML sees no GPU"
        report["accounting"] = self.accounting(devices, report["tensorflow"], unavailable)
        if unavailable is not None:
            return {"available": False, "reason": unavailable, **report}
        caps = {g.index: g.cap_mib for g in policy.gpus}
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
                    "cap_mib": caps.get(d.index),
                    "processes": [
                        {"pid": p.pid, "used_mib": p.used_mib, "this_process": p.pid == self._pid}
                        for p in d.processes
                    ],
                }
                for d in devices
            ],
            **report,
        }

    def _unavailable_reason(self) -> Optional[str]:
        if self.setup.nvml is None:
            return self.setup.nvml_reason or "NVML is unavailable"
        if self.setup.selected == ():
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

    def accounting(self, devices: Sequence[DeviceSnapshot], tf_memory, unavailable: Optional[str] = None) -> dict:
        """Attribute each process on the GPUs to an instance, and size what this instance holds unused."""
        fleet, fleet_note = self.fleet()
        by_pid = fleet.by_pid() if fleet is not None else {}
        me = fleet.named(self._instance_name) if fleet is not None and self._instance_name else None
        own_caps = {g.index: g.cap_mib for g in self.setup.policy.gpus}
        gpus = []
        for device in devices:
            rows = []
            for process in device.processes:
                mine = process.pid == self._pid
                instance = by_pid.get(process.pid)
                if instance is not None:
                    name, cap = instance.name, instance.caps_mib.get(device.index)
                elif mine:
                    name, cap = self._instance_name or "(this instance)", own_caps.get(device.index)
                else:
                    name, cap = OTHER, None
                rows.append({
                    "pid": process.pid, "instance": name, "this_process": mine, "used_mib": process.used_mib,
                    "cap_mib": cap, "overhead_mib": _overhead(process.used_mib, cap),
                })
            gpus.append({"index": device.index, "processes": rows})
        result = {
            "fleet": None if fleet is None else {
                "state_file": str(self._fleet_state), "fleet_pid": fleet.fleet_pid,
                "gpu_overhead_mib": fleet.gpu_overhead_mib,
                "instances": [i.name for i in fleet.instances],
            },
            "gpus": gpus,
            "this_instance": self._this_instance(devices, tf_memory, fleet, me, unavailable),
        }
        if fleet_note is not None:
            result["fleet_note"] = fleet_note
        return result

    def _this_instance(self, devices, tf_memory, fleet, me, unavailable) -> dict:
        policy = self.setup.policy
        used = {d.index: p.used_mib for d in devices for p in d.processes if p.pid == self._pid}
        visible = bool(used) if devices else None
        tf_by_index = _tf_by_physical(tf_memory, [g.index for g in policy.gpus])
        configured = fleet.gpu_overhead_mib if fleet is not None else None
        rows = []
        for gpu in policy.gpus:
            tf = tf_by_index.get(gpu.index, {})
            current = tf.get("current_mib")
            cap = me.caps_mib.get(gpu.index, gpu.cap_mib) if me is not None else gpu.cap_mib
            row = {"index": gpu.index, "used_mib": None, "tf_current_mib": current, "tf_peak_mib": tf.get("peak_mib"),
                   "cap_mib": cap, "overhead_mib": None, "overhead_from": None, "held_unused_mib": None}
            if visible:
                nvml_used = used.get(gpu.index)
                row["used_mib"] = nvml_used
                measured = _overhead(nvml_used, cap)
                if measured is not None:  # a capped allocator maps its whole cap: the rest is overhead
                    row["overhead_mib"], row["overhead_from"] = measured, "NVML used - cap"
                elif configured is not None:
                    row["overhead_mib"], row["overhead_from"] = configured, "the fleet's gpu_overhead_mib"
                if nvml_used is not None and current is not None and row["overhead_mib"] is not None:
                    row["held_unused_mib"] = round(nvml_used - current - row["overhead_mib"], 1)
            elif cap is not None and current is not None:
                row["held_unused_mib"] = round(cap - current, 1)  # TF's view: it maps its whole cap
            rows.append(row)
        if not policy.gpus:
            source, note = "tensorflow", policy.note or "TensorFlow uses no GPU"
        elif visible:
            source, note = "nvml", None
        elif visible is False:
            source, note = "tensorflow", PID_NOT_VISIBLE.format(pid=self._pid)
        else:
            source, note = "tensorflow", f"NVML is unavailable ({unavailable}); the figures are TensorFlow's own"
        return {"name": self._instance_name, "pid": self._pid, "pid_visible": visible, "source": source,
                "note": note, "gpus": rows}


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
