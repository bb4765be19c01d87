"""Open NVML and apply the settings' GPU memory policy: the boot step serving and training share."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from .errors import NvmlUnavailable
from .memory_policy import AppliedPolicy, apply_policy
from .nvml import Nvml
from .settings import Settings

log = logging.getLogger(__name__)


@dataclass
class GpuSetup:
    """What boot learnt about the GPUs: the applied policy, and NVML if it could be opened."""

    policy: AppliedPolicy
    nvml: Optional[Nvml]
    nvml_reason: Optional[str]  # why NVML is unavailable, where it is
    selected: Optional[tuple[int, ...]] = None  # DETECT_GPUS as given: None all, () none


def setup_gpus(settings: Settings, nvml_library=None, tf_config=None) -> GpuSetup:
    """Open NVML (if it can be) and apply the memory policy; raise PolicyError if it cannot be applied."""
    try:
        nvml: Optional[Nvml] = Nvml.open(nvml_library)
        reason = None
    except NvmlUnavailable as exc:
        nvml, reason = None, exc.message
        log.info("NVML unavailable: %s", reason)
    total = nvml.total_mib if nvml is not None else (lambda index: None)
    policy = apply_policy(settings.gpu_memory, settings.gpus, total, tf_config=tf_config)
    return GpuSetup(policy=policy, nvml=nvml, nvml_reason=reason, selected=settings.gpus)
