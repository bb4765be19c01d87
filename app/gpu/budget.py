"""The GPU memory budget, shared by the fleet's planner and the model registry: pure arithmetic.

The rule, per GPU: the caps of the processes that may use it, plus one `overhead_mib` for each of
them (CUDA context, cuDNN/cuBLAS workspaces: memory beyond TensorFlow's cap), must fit into the GPU's
memory (NVML's total less what the driver reserves, or a total given for planning). A share
(`25%`) is sized from the GPU's total exactly as `memory_policy` sizes it in the process itself.
`greedy` and `growth` have no cap, so they cannot be budgeted beside other processes.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Optional, Sequence

from .memory_policy import MemorySpec


@dataclass(frozen=True)
class Gpu:
    """One GPU a budget may use."""

    index: int
    total_mib: int  # what the budget may fill: NVML's total, or a total given for planning
    reserved_mib: int = 0  # kept by the driver (NVML memory info v2), not usable
    name: str = ""
    in_use_mib: int = 0  # used by other processes when the inventory was taken (NVML)
    device_total_mib: Optional[int] = None  # NVML's total, where a planning total stands in for the budget

    @property
    def available_mib(self) -> int:
        return self.total_mib - self.reserved_mib


def cap_mib(spec: MemorySpec, gpu: Gpu) -> Optional[int]:
    """Return the cap `spec` sets on `gpu` (None for growth and greedy), as memory_policy applies it.

    A share is of the device's whole memory, as the process sizes it from NVML, even where the budget
    is a smaller planning total (a GPU shared by several pods, each with its gpu_total_mib).
    """
    if spec.mode == "share":
        whole = gpu.device_total_mib or gpu.total_mib
        return max(1, math.floor(whole * spec.share_percent / 100))
    if spec.mode == "cap":
        return spec.cap_mib
    return None


def needed_mib(caps: Iterable[Optional[int]], overhead_mib: int) -> int:
    """Return what processes with these caps take from one GPU: the caps plus one overhead each."""
    caps = list(caps)
    return sum(c or 0 for c in caps) + overhead_mib * len(caps)


@dataclass(frozen=True)
class Shortfall:
    """Why a reservation does not fit: on which GPU, how much it needs and how much is left."""

    gpu: int
    needed_mib: int
    available_mib: int
    holders: tuple[str, ...]  # what holds the rest of that GPU

    def describe(self) -> str:
        held = f" (held by {', '.join(self.holders)})" if self.holders else ""
        return (f"GPU {self.gpu} needs {self.needed_mib} MiB for it but has {self.available_mib} MiB "
                f"left of its budget{held}")


class Ledger:
    """Reservations of GPU memory by the processes the server starts; thread-safe.

    A reservation is `{gpu index: cap MiB or None}` under a key; it takes cap + overhead from each of
    its GPUs, and is held from before its process starts until after the process has exited.
    """

    def __init__(self, gpus: Iterable[Gpu], overhead_mib: int):
        self.gpus = {g.index: g for g in gpus}
        self.overhead_mib = overhead_mib
        self._held: dict[Hashable, tuple[str, dict[int, Optional[int]]]] = {}
        self._lock = threading.Lock()

    def used_mib(self, index: int) -> int:
        """Return what the reservations take from one GPU now."""
        with self._lock:
            return self._used(index)

    def _used(self, index: int) -> int:
        return needed_mib((caps[index] for _, caps in self._held.values() if index in caps), self.overhead_mib)

    def shortfall(self, caps: Mapping[int, Optional[int]]) -> Optional[Shortfall]:
        """Return why `caps` would not fit beside the reservations held now, or None if they fit."""
        with self._lock:
            return self._shortfall(caps)

    def _shortfall(self, caps: Mapping[int, Optional[int]]) -> Optional[Shortfall]:
        for index, cap in caps.items():
            gpu = self.gpus.get(index)
            if gpu is None:
                continue  # no inventory for it: nothing to check against
            need = needed_mib([cap], self.overhead_mib)
            left = gpu.available_mib - self._used(index)
            if need > left:
                holders = tuple(label for label, held in self._held.values() if index in held)
                return Shortfall(index, need, left, holders)
        return None

    def reserve(self, key: Hashable, label: str, caps: Mapping[int, Optional[int]]) -> Optional[Shortfall]:
        """Reserve `caps` under `key` if they fit; return None on success, else the shortfall."""
        with self._lock:
            short = self._shortfall(caps)
            if short is None:
                self._held[key] = (label, dict(caps))
            return short

    def release(self, key: Hashable) -> None:
        """Give a reservation back (its process has exited); unknown keys are ignored."""
        with self._lock:
            self._held.pop(key, None)

    def to_json(self) -> list[dict]:
        with self._lock:
            return [
                {"index": g.index, "total_mib": g.total_mib, "available_mib": g.available_mib,
                 "reserved_mib": self._used(g.index), "overhead_mib": self.overhead_mib,
                 "holders": [label for label, caps in self._held.values() if g.index in caps]}
                for g in sorted(self.gpus.values(), key=lambda g: g.index)
            ]


def inventory(devices: Sequence, total_mib: int = 0, selected: Optional[Sequence[int]] = None,
              named: Iterable[int] = ()) -> Optional[list[Gpu]]:
    """Return the GPUs to budget on: NVML's devices, or GPUs of `total_mib` each when it is given.

    `devices` are NVML snapshots (app.gpu.nvml.DeviceSnapshot). With `total_mib` and no NVML, the
    GPUs are 0 and every index in `named`. `selected` (DETECT_GPUS) keeps those indices only (() none).
    None means no inventory: nothing to budget against.
    """
    if selected == ():
        return None
    if total_mib:
        known = {d.index: d.memory_total_mib for d in devices}
        indices = sorted(known) or sorted({0, *named, *(selected or ())})
        gpus = [Gpu(index=i, total_mib=total_mib, device_total_mib=known.get(i)) for i in indices]
    elif devices:
        gpus = [Gpu(index=d.index, total_mib=d.memory_total_mib, reserved_mib=d.memory_reserved_mib or 0,
                    name=d.name, in_use_mib=d.memory_used_mib) for d in devices]
    else:
        return None
    return [g for g in gpus if selected is None or g.index in selected]
