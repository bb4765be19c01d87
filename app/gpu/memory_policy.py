"""Parse a GPU memory policy and apply it to TensorFlow: the only module that touches `tf.config`.

Serving and training both call `apply_policy` before TensorFlow creates any tensor. The policy is
one of:

- ``greedy``: TensorFlow's default; it maps nearly all memory of every visible GPU at start.
- ``growth``: memory growth; TensorFlow starts small and grows, but never gives memory back.
- a size (``4096``, ``4096MiB``, ``4GiB``): a hard cap on TensorFlow's allocator, per GPU.
- a share (``25%``): that share of each selected GPU's total memory, read from NVML, as a hard cap.

A cap bounds TensorFlow's allocator only. The CUDA context and the cuDNN/cuBLAS workspaces come on
top of it, a few hundred MiB per process.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..errors import PolicyError

log = logging.getLogger(__name__)

MEMORY_SPEC_FORMS = "'greedy', 'growth', a size in MiB ('4096', '4096MiB', '4GiB') or a share ('25%')"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(mib|gib|m|g)?\s*$", re.IGNORECASE)
_SHARE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class MemorySpec:
    """What the user asked for; `apply_policy` turns it into caps per GPU."""

    mode: str  # "greedy" | "growth" | "cap" | "share"
    cap_mib: Optional[int] = None  # mode "cap": the cap on each selected GPU
    share_percent: Optional[float] = None  # mode "share": percent of each GPU's total memory

    def __str__(self) -> str:
        if self.mode == "cap":
            return f"{self.cap_mib}MiB"
        if self.mode == "share":
            return f"{self.share_percent:g}%"
        return self.mode


def parse_memory_spec(text: str) -> MemorySpec:
    """Parse a DETECT_GPU_MEMORY value; raise ValueError saying what is allowed."""
    raw = str(text).strip()
    word = raw.lower()
    if word in ("greedy", "growth"):
        return MemorySpec(mode=word)
    share = _SHARE.match(raw)
    if share:
        percent = float(share.group(1))
        if not 0 < percent <= 100:
            raise ValueError(f"a share must be above 0% and at most 100%, not {raw!r}")
        return MemorySpec(mode="share", share_percent=percent)
    size = _SIZE.match(raw)
    if size:
        number, unit = float(size.group(1)), (size.group(2) or "mib").lower()
        mib = number * 1024 if unit in ("gib", "g") else number
        if mib != int(mib):
            raise ValueError(f"a cap must be a whole number of MiB, not {raw!r}")
        if mib <= 0:
            raise ValueError(f"a cap must be above 0 MiB, not {raw!r}")
        return MemorySpec(mode="cap", cap_mib=int(mib))
    raise ValueError(f"expected {MEMORY_SPEC_FORMS}")


def parse_gpu_list(text: str) -> Optional[tuple[int, ...]]:
    """Parse a DETECT_GPUS value: '' for all GPUs, 'none' for none, or indices like '0,1'."""
    raw = str(text).strip().lower()
    if raw in ("", "all"):
        return None
    if raw == "none":
        return ()
    try:
        indices = tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise ValueError("expected '' or 'all' (every GPU), 'none', or GPU indices like '0' or '0,1'") from None
    if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise ValueError("GPU indices must be distinct and not negative")
    return indices


@dataclass(frozen=True)
class GpuCap:
    """The policy as applied to one physical GPU."""

    index: int  # physical index, in PCI bus order (as nvidia-smi shows it)
    cap_mib: Optional[int]  # None: greedy or growth, no cap
    total_mib: Optional[int]  # from NVML, None where NVML is unavailable


@dataclass(frozen=True)
class AppliedPolicy:
    """What `apply_policy` did; logged at boot and reported by /gpu."""

    mode: str
    spec: str
    gpus: tuple[GpuCap, ...]
    note: Optional[str] = None  # e.g. why there was nothing to apply to

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "spec": self.spec,
            "gpus": [{"index": g.index, "cap_mib": g.cap_mib, "total_mib": g.total_mib} for g in self.gpus],
            "note": self.note,
        }

    def memory_limit(self) -> str:
        """Name what bounds this process's model memory, for out-of-memory errors."""
        caps = sorted({g.cap_mib for g in self.gpus if g.cap_mib is not None})
        if caps:
            return f"the GPU memory cap of {'/'.join(str(c) for c in caps)} MiB"
        if self.gpus:
            return f"GPU memory policy {self.spec} (no cap)"
        return "the host's memory (no GPU)"

    def describe(self) -> str:
        if not self.gpus:
            return f"GPU memory policy {self.spec}: {self.note}"
        caps = ", ".join(
            f"GPU {g.index}: " + (f"cap {g.cap_mib} MiB" if g.cap_mib is not None else self.mode)
            + (f" of {g.total_mib} MiB" if g.total_mib is not None else "")
            for g in self.gpus
        )
        return f"GPU memory policy {self.spec} applied ({caps})"


def _tf_config():
    import tensorflow as tf

    return tf.config


def apply_policy(
    spec: MemorySpec,
    gpus: Optional[Sequence[int]] = None,
    total_mib: Callable[[int], Optional[int]] = lambda index: None,
    tf_config=None,
) -> AppliedPolicy:
    """Select GPUs and apply the memory policy; call before TensorFlow creates any tensor.

    `gpus` are physical indices (None: all). `total_mib(index)` gives a GPU's total memory from
    NVML, or None where NVML is unavailable. `tf_config` is `tf.config` unless a test passes a stand-in.
    Raise PolicyError when the policy cannot be applied, including when TensorFlow already initialized
    its GPUs (the policy would be silently ignored otherwise).
    """
    config = tf_config if tf_config is not None else _tf_config()
    physical = list(config.list_physical_devices("GPU"))
    if gpus is None:
        selected = list(enumerate(physical))
    else:
        missing = [i for i in gpus if i >= len(physical)]
        if missing and physical:
            raise PolicyError(
                f"DETECT_GPUS asks for GPU {missing[0]}, but TensorFlow sees {len(physical)} GPU(s), "
                f"indices 0 to {len(physical) - 1}"
            )
        selected = [(i, physical[i]) for i in gpus if i < len(physical)]

    if not selected:
        note = (
            "no GPU is visible to TensorFlow; nothing to apply, serving on the CPU"
            if not physical
            else "no GPU selected (DETECT_GPUS=none); running on the CPU"
        )
        if physical:
            _set_visible(config, [])
        result = AppliedPolicy(mode=spec.mode, spec=str(spec), gpus=(), note=note)
        log.info("%s", result.describe())
        return result

    caps = []
    for index, _device in selected:
        total = total_mib(index)
        caps.append(GpuCap(index=index, cap_mib=_cap_for(spec, index, total), total_mib=total))

    _set_visible(config, [device for _, device in selected])
    for (index, device), cap in zip(selected, caps):
        try:
            if spec.mode == "growth":
                config.experimental.set_memory_growth(device, True)
            elif cap.cap_mib is not None:
                config.set_logical_device_configuration(
                    device, [config.LogicalDeviceConfiguration(memory_limit=cap.cap_mib)]
                )
        except RuntimeError as exc:
            raise _already_initialized(exc) from exc
    result = AppliedPolicy(mode=spec.mode, spec=str(spec), gpus=tuple(caps))
    log.info("%s", result.describe())
    return result


def _cap_for(spec: MemorySpec, index: int, total: Optional[int]) -> Optional[int]:
    if spec.mode == "share":
        if total is None:
            raise PolicyError(
                f"DETECT_GPU_MEMORY={spec} is a share of the GPU, which needs NVML to read GPU {index}'s "
                "total memory, and NVML is unavailable; give a size such as 4GiB instead"
            )
        return max(1, math.floor(total * spec.share_percent / 100))
    if spec.mode == "cap":
        if total is not None and spec.cap_mib > total:
            raise PolicyError(
                f"DETECT_GPU_MEMORY={spec} is larger than GPU {index}, which has {total} MiB in all"
            )
        return spec.cap_mib
    return None


def _set_visible(config, devices) -> None:
    try:
        config.set_visible_devices(devices, "GPU")
    except RuntimeError as exc:
        raise _already_initialized(exc) from exc


def _already_initialized(exc: RuntimeError) -> PolicyError:
    return PolicyError(
        "TensorFlow has already initialized its GPUs, so the memory policy cannot be applied "
        f"({exc}); apply it before any tensor is created"
    )


def tensorflow_memory_info(tf_config=None) -> list[dict]:
    """Return TensorFlow's own current and peak allocator use per logical GPU, in MiB."""
    config = tf_config if tf_config is not None else _tf_config()
    report = []
    for device in config.list_logical_devices("GPU"):
        try:
            info = config.experimental.get_memory_info(device.name)
        except (ValueError, RuntimeError) as exc:
            report.append({"device": device.name, "error": str(exc)})
            continue
        report.append({
            "device": device.name,
            "current_mib": round(info["current"] / 2**20, 1),
            "peak_mib": round(info["peak"] / 2**20, 1),
        })
    return report

