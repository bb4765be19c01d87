"""`python -m app calibrate --group <name>`: settle a worker group's cap from all of its members' peaks.

A group's worker holds every member at once, and each member's `inference_threads` calls may run at the
same moment as the others': the group's cap is the sum of the members' TensorFlow peaks, each measured by
calibrate's growth run (in a fresh process, as for one model), plus the headroom. Its capped run, and so
the measured overhead, is not made: it would need every member loaded in one measuring process, which
calibrate's run does not do; gpu_overhead_mib keeps the value a model's own calibration measured.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from ..gpu.memory_policy import MemorySpec


def group_members(settings, group: str) -> list[tuple[str, Path]]:
    """The models of the repository that name `group`, with their base paths; raise ConfigError if none does."""
    from ..models.repository import ModelRepository

    repository = ModelRepository.open(settings.model_repository)
    members = [(name, Path(settings.model_repository) / name) for name in repository.names()
               if settings.for_model(name).worker_group == group]
    if not members:
        raise ConfigError(f"no model of {settings.model_repository} names worker group {group!r}: set "
                          f'worker_group = "{group}" in their [models.<name>] tables')
    return members


def calibrate_group(members: list[tuple[str, Path]], run_growth: Callable[[str, Path], float],
                    headroom_percent: float = 20.0) -> tuple[int, dict[str, float]]:
    """Measure each member's peak (`run_growth(name, path)` gives TensorFlow's peak MiB); return the cap and peaks."""
    peaks = {name: run_growth(name, path) for name, path in members}
    return max(1, math.ceil(sum(peaks.values()) * (1 + headroom_percent / 100))), peaks


def report_group(group: str, cap_mib: int, peaks: dict[str, float], headroom_percent: float) -> str:
    lines = [f"worker group {group}: {len(peaks)} member(s)"]
    lines += [f"  {name}: TensorFlow peak {peak:.1f} MiB" for name, peak in peaks.items()]
    lines.append(f"recommended cap for the group: {cap_mib} MiB (the members' peaks, {sum(peaks.values()):.1f} MiB, "
                 f"+ {headroom_percent:g}%); a new version of its largest member loads beside the old one, so "
                 f"keep room for it")
    return "\n".join(lines)


def write_group_cap(path: Path, group: str, cap_mib: int, total_peak_mib: float, headroom_percent: float) -> str:
    """Set `gpu_memory` in the settings file's [groups.<group>] table (created if missing); return what was written."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    cap = f'gpu_memory = "{cap_mib}MiB"  # calibrated: the members\' TensorFlow peaks {total_peak_mib:.0f} MiB + ' \
          f'{headroom_percent:g}%'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(set_gpu_memory(text.splitlines(), "groups", group, cap))
    return f"wrote {path}: [groups.{group}] gpu_memory {cap_mib}MiB"


def set_gpu_memory(lines: list[str], section: str, name: str, cap: str) -> str:
    """Put the `cap` line (gpu_memory = ...) first in a settings file's [<section>.<name>] table, made if missing."""
    header = re.compile(rf"\s*\[\s*{section}\.(\"?){re.escape(name)}\1\s*\]")
    start = next((i for i, line in enumerate(lines) if header.match(line)), None)
    if start is None:
        lines += ["", f"[{section}.{name}]", cap]
    else:
        end = next((i for i in range(start + 1, len(lines)) if re.match(r"\s*\[", lines[i])), len(lines))
        body = [line for line in lines[start + 1:end] if not re.match(r"\s*gpu_memory\s*=", line)]
        lines[start + 1:end] = [cap, *body]
    return "\n".join(lines) + "\n"


GROWTH = MemorySpec(mode="growth")
