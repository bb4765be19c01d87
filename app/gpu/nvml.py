"""The NVML boundary: the only module that imports pynvml (NVIDIA's nvidia-ml-py).

It opens NVML once, reads what nvidia-smi would show, and turns every NVML failure into
NvmlUnavailable. All calls are thread-safe (NVML itself is), so WSGI threads may share one Nvml.
Tests pass a stand-in `library` with pynvml's function names and recorded answers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import NvmlUnavailable

try:
    import pynvml as _pynvml
except ImportError:  # the package is a dependency, but a slim image may lack it
    _pynvml = None

MIB = 2**20


@dataclass(frozen=True)
class ProcessUsage:
    """One compute process on a GPU, as NVML reports it."""

    pid: int
    used_mib: Optional[int]  # None where NVML cannot tell (e.g. some containers)


@dataclass(frozen=True)
class DeviceSnapshot:
    """One GPU's identity, memory and load at the moment it was read."""

    index: int
    name: str
    uuid: str
    memory_total_mib: int
    memory_used_mib: int
    memory_free_mib: int
    memory_reserved_mib: Optional[int]  # memory info v2 only: kept by the driver, not usable
    utilization_percent: Optional[int]  # None where the device does not report it
    processes: tuple[ProcessUsage, ...]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """An open NVML session; build it with `Nvml.open()`."""

    def __init__(self, library):
        self._nv = library
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, library=None) -> "Nvml":
        """Initialize NVML; raise NvmlUnavailable with the reason where it cannot be."""
        nv = library if library is not None else _pynvml
        if nv is None:
            raise NvmlUnavailable("the nvidia-ml-py package is not installed")
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            raise NvmlUnavailable(f"NVML cannot be initialized: {exc} (no NVIDIA driver on this host?)") from None
        except OSError as exc:
            raise NvmlUnavailable(f"the NVML library cannot be loaded: {exc}") from None
        return cls(nv)

    def close(self) -> None:
        """Shut NVML down; later calls raise NvmlUnavailable."""
        with self._lock:
            if not self._closed:
                self._closed = True
                try:
                    self._nv.nvmlShutdown()
                except self._nv.NVMLError:
                    pass

    def _call(self, fn, *args, **kwargs):
        if self._closed:
            raise NvmlUnavailable("NVML was shut down")
        try:
            return fn(*args, **kwargs)
        except self._nv.NVMLError as exc:
            raise NvmlUnavailable(f"NVML call {getattr(fn, '__name__', fn)} failed: {exc}") from None

    def driver_version(self) -> str:
        return _text(self._call(self._nv.nvmlSystemGetDriverVersion))

    def cuda_driver_version(self) -> str:
        """Return the CUDA version the driver supports, as '12.4'."""
        code = int(self._call(self._nv.nvmlSystemGetCudaDriverVersion))
        return f"{code // 1000}.{code % 1000 // 10}"

    def device_count(self) -> int:
        return int(self._call(self._nv.nvmlDeviceGetCount))

    def total_mib(self, index: int) -> Optional[int]:
        """Return one GPU's total memory in MiB, or None if there is no such GPU."""
        if index >= self.device_count():
            return None
        handle = self._call(self._nv.nvmlDeviceGetHandleByIndex, index)
        return self._memory(handle)[0]

    def snapshot(self, indices: Optional[Sequence[int]] = None) -> list[DeviceSnapshot]:
        """Read the GPUs given by index (None: every GPU)."""
        count = self.device_count()
        wanted = range(count) if indices is None else [i for i in indices if i < count]
        return [self._device(i) for i in wanted]

    def _memory(self, handle) -> tuple[int, int, int, Optional[int]]:
        nv = self._nv
        version = getattr(nv, "nvmlMemory_v2", None)
        if version is not None:
            try:
                info = nv.nvmlDeviceGetMemoryInfo(handle, version=version)
                return (info.total // MIB, info.used // MIB, info.free // MIB, info.reserved // MIB)
            except nv.NVMLError:
                pass  # drivers before 510 have no v2: fall back to v1
        info = self._call(nv.nvmlDeviceGetMemoryInfo, handle)
        return (info.total // MIB, info.used // MIB, info.free // MIB, None)

    def _device(self, index: int) -> DeviceSnapshot:
        nv = self._nv
        handle = self._call(nv.nvmlDeviceGetHandleByIndex, index)
        total, used, free, reserved = self._memory(handle)
        try:
            utilization = int(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nv.NVMLError:
            utilization = None
        processes = tuple(
            ProcessUsage(pid=int(p.pid), used_mib=_used_mib(p.usedGpuMemory))
            for p in self._call(nv.nvmlDeviceGetComputeRunningProcesses, handle)
        )
        return DeviceSnapshot(
            index=index,
            name=_text(self._call(nv.nvmlDeviceGetName, handle)),
            uuid=_text(self._call(nv.nvmlDeviceGetUUID, handle)),
            memory_total_mib=total,
            memory_used_mib=used,
            memory_free_mib=free,
            memory_reserved_mib=reserved,
            utilization_percent=utilization,
            processes=processes,
        )


def _used_mib(value) -> Optional[int]:
    # NVML reports NVML_VALUE_NOT_AVAILABLE (2**64 - 1) or None where it cannot attribute memory.
    if value is None or value >= 2**63:
        return None
    return int(value) // MIB
