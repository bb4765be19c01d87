"""A stand-in for `tf.config` on a machine with GPUs, for the policy logic on this GPU-less machine.

It records what apply_policy asks of it, and raises RuntimeError like TensorFlow does once the
GPUs are initialized; it describes each GPU as TensorFlow does (name, compute capability), and records
the Grappler options app/inference/accelerators.py sets.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PhysicalDevice:
    name: str
    device_type: str = "GPU"


@dataclass(frozen=True)
class LogicalDeviceConfiguration:
    memory_limit: int | None = None


class _Experimental:
    def __init__(self, owner):
        self._owner = owner

    def set_memory_growth(self, device, enable):
        self._owner._check()
        self._owner.calls.append(("set_memory_growth", device.name, enable))

    def get_device_details(self, device):
        return {"device_name": self._owner.gpu_name, "compute_capability": self._owner.compute_capability}


class _Optimizer:
    def __init__(self, owner):
        self._owner = owner

    def set_experimental_options(self, options):
        self._owner.options.update(options)
        self._owner.calls.append(("set_experimental_options", dict(options)))


class FakeTfConfig:
    LogicalDeviceConfiguration = LogicalDeviceConfiguration

    def __init__(self, gpus: int, initialized: bool = False, compute_capability=(9, 0), gpu_name="NVIDIA H100"):
        self.devices = [PhysicalDevice(f"/physical_device:GPU:{i}") for i in range(gpus)]
        self.visible = list(self.devices)
        self.initialized = initialized
        self.calls: list[tuple] = []
        self.options: dict = {}  # Grappler's experimental options as last set
        self.compute_capability, self.gpu_name = compute_capability, gpu_name
        self.experimental = _Experimental(self)
        self.optimizer = _Optimizer(self)

    def _check(self):
        if self.initialized:
            raise RuntimeError("Physical devices cannot be modified after being initialized")

    def list_physical_devices(self, kind):
        return list(self.devices) if kind == "GPU" else []

    def set_visible_devices(self, devices, kind):
        self._check()
        self.calls.append(("set_visible_devices", [d.name for d in devices], kind))
        self.visible = list(devices)

    def get_visible_devices(self, kind):
        return list(self.visible) if kind == "GPU" else []

    def set_logical_device_configuration(self, device, configs):
        self._check()
        self.calls.append(("set_logical_device_configuration", device.name, [c.memory_limit for c in configs]))
