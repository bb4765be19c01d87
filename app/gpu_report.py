"""Build the /gpu report: what NVML sees of this process's GPUs, the applied policy, TensorFlow's view."""

from __future__ import annotations

import os
from typing import Callable, Optional

from .errors import NvmlUnavailable
from .gpu_setup import GpuSetup
from .memory_policy import tensorflow_memory_info


class GpuReport:
    """Report GPU state on demand; called from WSGI threads, thread-safe."""

    def __init__(self, setup: GpuSetup, tf_memory: Callable[[], list[dict]] = tensorflow_memory_info,
                 pid: Optional[int] = None):
        self.setup = setup
        self._tf_memory = tf_memory
        self._pid = os.getpid() if pid is None else pid

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
        nvml = self.setup.nvml
        if nvml is None:
            return {"available": False, "reason": self.setup.nvml_reason, **report}
        if self.setup.selected == ():
            return {"available": False, "reason": "no GPU selected (DETECT_GPUS=none)", **report}
        try:
            devices = self.devices()
            driver = nvml.driver_version()
            cuda = nvml.cuda_driver_version()
        except NvmlUnavailable as exc:
            return {"available": False, "reason": exc.message, **report}
        if not devices:
            return {"available": False, "reason": "NVML sees no GPU", **report}
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
