"""Open NVML and apply a GPU memory policy: the boot step that model workers, training and calibration share."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import NvmlUnavailable
from .memory_policy import AppliedPolicy, MemorySpec, apply_policy
from .nvml import Nvml

log = logging.getLogger(__name__)


@dataclass
class GpuSetup:
    """What boot learnt about the GPUs: the applied policy, and NVML if it could be opened."""

    policy: AppliedPolicy
    nvml: Optional[Nvml]
    nvml_reason: Optional[str]  # why NVML is unavailable, where it is
    selected: Optional[tuple[int, ...]] = None  # DETECT_GPUS as given: None all, () none


def open_nvml(nvml_library=None) -> tuple[Optional[Nvml], Optional[str]]:
    """Open NVML if it can be; return it, or None and the reason."""
    try:
        return Nvml.open(nvml_library), None
    except NvmlUnavailable as exc:
        log.info("NVML unavailable: %s", exc.message)
        return None, exc.message


def setup_gpus(spec: MemorySpec, gpus: Optional[Sequence[int]], nvml_library=None, tf_config=None) -> GpuSetup:
    """Open NVML (if it can be) and apply the memory policy; raise PolicyError if it cannot be applied.

    Call it before TensorFlow creates any tensor, in the process that will run the model.
    """
    from ..process import configure_cuda_order, quiet_tensorflow_startup

    configure_cuda_order()
    quiet_tensorflow_startup()
    nvml, reason = open_nvml(nvml_library)
    total = nvml.total_mib if nvml is not None else (lambda index: None)
    policy = apply_policy(spec, gpus, total, tf_config=tf_config)
    return GpuSetup(policy=policy, nvml=nvml, nvml_reason=reason, selected=None if gpus is None else tuple(gpus))
