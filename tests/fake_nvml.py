"""A stand-in for the pynvml module, for the NVML boundary on this GPU-less machine.

Its answers are shaped like an H200 host's (nvidia-ml-py 13, driver 580): two devices, memory
info v2, two compute processes on GPU 0. Built only from pynvml's public function names.
"""

from __future__ import annotations

from types import SimpleNamespace

MIB = 2**20


class NVMLError(Exception):
    pass


class NVMLErrorNotSupported(NVMLError):
    pass


class FakeNvml:
    NVMLError = NVMLError
    nvmlMemory_v2 = 0x02000028

    def __init__(self, own_pid: int, init_error: Exception | None = None, v2: bool = True):
        self.init_error = init_error
        self.v2 = v2
        self.shut_down = False
        self.devices = [
            dict(name="NVIDIA H200", uuid="GPU-5a1c0d3e-0000-4000-8000-000000000000", total=143771, used=9302,
                 reserved=555, util=37,
                 processes=[SimpleNamespace(pid=own_pid, usedGpuMemory=4596 * MIB),
                            SimpleNamespace(pid=4242, usedGpuMemory=4150 * MIB)]),
            dict(name=b"NVIDIA H200", uuid=b"GPU-5a1c0d3e-0000-4000-8000-000000000001", total=143771, used=0,
                 reserved=555, util=None, processes=[SimpleNamespace(pid=777, usedGpuMemory=None)]),
        ]

    def set_processes(self, index: int, *processes: tuple[int, int | None]) -> None:
        """Replace GPU `index`'s compute processes with (pid, used MiB) pairs; its used memory follows."""
        self.devices[index]["processes"] = [
            SimpleNamespace(pid=pid, usedGpuMemory=None if used is None else used * MIB) for pid, used in processes
        ]
        self.devices[index]["used"] = sum(used or 0 for _, used in processes)

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlSystemGetDriverVersion(self):
        return "580.95.05"

    def nvmlSystemGetCudaDriverVersion(self):
        return 13000

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        if index >= len(self.devices):
            raise NVMLError("Invalid Argument")
        return self.devices[index]

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        total, used, reserved = handle["total"] * MIB, handle["used"] * MIB, handle["reserved"] * MIB
        if version is None:
            return SimpleNamespace(total=total, used=used + reserved, free=total - used - reserved)
        if not self.v2:
            raise NVMLError("Function Not Found")
        return SimpleNamespace(total=total, used=used, free=total - used - reserved, reserved=reserved)

    def nvmlDeviceGetUtilizationRates(self, handle):
        if handle["util"] is None:
            raise NVMLErrorNotSupported("Not Supported")
        return SimpleNamespace(gpu=handle["util"], memory=10)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return handle["processes"]

    def nvmlDeviceGetName(self, handle):
        return handle["name"]

    def nvmlDeviceGetUUID(self, handle):
        return handle["uuid"]
