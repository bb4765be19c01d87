"""Read a fleet file and plan its instances onto GPUs: pure, no processes, no NVML, no TensorFlow.

A fleet file is TOML::

    gpu_overhead_mib = 1024         # per process, on top of its cap: CUDA context, cuDNN/cuBLAS workspaces
    [[instance]]
    name = "faces"
    model = "models/faces"
    port = 8001
    grpc_port = 9001                # optional; without it the instance has no gRPC port (off)
    gpu_memory = "4GiB"             # same forms as DETECT_GPU_MEMORY
    # gpus = "0"                    # optional, as DETECT_GPUS

Every instance key but `name` is a serve setting; the fleet hands them to the instance as DETECT_*
variables. An instance's gRPC port is off unless it gives `grpc_port`: serve's default, 8001, is one
port for one process, and the example fleet's HTTP ports start there. The budget rule, per GPU: the sum of the caps of the instances that may use it, plus one
`gpu_overhead_mib` per instance, must fit in the GPU's memory (NVML's total less what the driver
reserves, or `--gpu-total-mib`).
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import ConfigError
from .state import OTHER
from ..gpu.budget import Gpu, cap_mib, needed_mib
from ..gpu.memory_policy import MemorySpec
from ..settings import env_name, setting_fields

# Settings the fleet sets itself on every instance; a fleet file may not.
FLEET_OWNED = ("fleet_state", "instance_name", "notify_fd")
REQUIRED = ("name", "model", "port")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class FleetOption:
    """The range of a top-level key of the fleet file; FleetConfig holds its default."""

    lo: float
    hi: float
    kind: type


FLEET_OPTIONS = {
    "gpu_overhead_mib": FleetOption(0, 65536, int),
    "max_failures": FleetOption(1, 1000, int),
    "failure_window_s": FleetOption(1, 86400, float),
    "restart_backoff_s": FleetOption(0, 600, float),
    "ready_timeout_s": FleetOption(1, 3600, float),
    "stop_timeout_s": FleetOption(1, 3600, float),
}


@dataclass(frozen=True)
class InstanceSpec:
    """One instance as the fleet file gives it."""

    name: str
    model: str
    port: int  # 0: any free port, learnt from the instance's log
    gpu_memory: MemorySpec
    gpus: Optional[tuple[int, ...]]  # as DETECT_GPUS: None every GPU, () none
    settings: tuple[tuple[str, str], ...]  # every serve setting given, raw, for DETECT_* variables
    host: str = "127.0.0.1"
    grpc_port: Optional[int] = None  # None: off (the fleet's default), 0: any free port

    def env(self) -> dict[str, str]:
        """Return the DETECT_* variables that make `python -m app serve` this instance."""
        values = dict(self.settings)
        values.update(model=self.model, port=str(self.port), gpu_memory=str(self.gpu_memory),
                      gpus=_gpus_text(self.gpus), grpc_port="off" if self.grpc_port is None else str(self.grpc_port))
        return {env_name(key): value for key, value in values.items()}


@dataclass(frozen=True)
class FleetConfig:
    """A validated fleet file."""

    path: Path
    instances: tuple[InstanceSpec, ...]
    gpu_overhead_mib: int = 1024  # budgeted per instance on top of its cap (MiB); as the serve setting's default
    max_failures: int = 5  # an instance that exits this often within failure_window_s is given up
    failure_window_s: float = 300.0  # (s)
    restart_backoff_s: float = 1.0  # first restart delay, doubled for each exit in the window, at most 60 s
    ready_timeout_s: float = 300.0  # an instance not ready by then is killed, which counts as an exit (s)
    stop_timeout_s: float = 40.0  # on stop, SIGKILL what has not drained by then (s)


def _gpus_text(gpus: Optional[tuple[int, ...]]) -> str:
    if gpus is None:
        return ""
    return ",".join(str(i) for i in gpus) if gpus else "none"


def load_fleet(path: Path) -> FleetConfig:
    """Read and validate a fleet file; raise ConfigError naming the file, the instance and the key."""
    try:
        with Path(path).open("rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"fleet file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"fleet file {path} cannot be read: {exc}") from None
    return parse_fleet(data, Path(path))


def parse_fleet(data: dict, path: Path) -> FleetConfig:
    """Validate the parsed TOML of a fleet file."""
    where = f"fleet file {path}"
    known = ", ".join([*FLEET_OPTIONS, "instance"])
    for key in data:
        if key not in FLEET_OPTIONS and key != "instance":
            raise ConfigError(f"{where} has unknown key {key!r}; known keys: {known}")
    options = {key: _option(where, key, data[key], FLEET_OPTIONS[key]) for key in FLEET_OPTIONS if key in data}
    tables = data.get("instance")
    if isinstance(tables, dict):
        raise ConfigError(f"{where}: write each instance as [[instance]] (an array of tables), not [instance]")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{where} lists no instance; add one [[instance]] table per instance")
    instances = tuple(_instance(where, i + 1, table) for i, table in enumerate(tables))
    _check_unique(where, instances)
    return FleetConfig(path=path, instances=instances, **options)


def _option(where: str, key: str, raw: Any, option: FleetOption):
    allowed = f"expected {'an integer' if option.kind is int else 'a number'} from {option.lo:g} to {option.hi:g}"
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or (option.kind is int and not isinstance(raw, int)):
        raise ConfigError(f"{where}: {key} has value {raw!r}: {allowed}")
    if not (math.isfinite(raw) and option.lo <= raw <= option.hi):
        raise ConfigError(f"{where}: {key} has value {raw!r}: {allowed}")
    return option.kind(raw)


def _instance(where: str, number: int, table: Any) -> InstanceSpec:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: instance {number} is not a table")
    label = f"{where}: instance {number}" + (f" ({table['name']!r})" if isinstance(table.get("name"), str) else "")
    fields = {f.name: f for f in setting_fields() if f.name not in FLEET_OWNED}
    for key in table:
        if key == "name":
            continue
        if key in FLEET_OWNED:
            raise ConfigError(f"{label}: {key} is set by the fleet itself and may not be given")
        if key not in fields:
            raise ConfigError(f"{label} has unknown key {key!r}; known keys: name, {', '.join(fields)}")
    missing = [key for key in REQUIRED if key not in table]
    if missing:
        raise ConfigError(f"{label} lacks {', '.join(missing)}; every instance needs name, model and port")
    name = table["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{label}: name {name!r} must be letters, digits, '.', '_' or '-' (at most 63)")
    if name == OTHER:
        raise ConfigError(f"{label}: the name {OTHER!r} is kept for processes of no instance in /gpu")
    parsed: dict[str, Any] = {}
    for key, raw in table.items():
        if key == "name":
            continue
        if isinstance(raw, (dict, list)):
            raise ConfigError(f"{label}: {key} has value {raw!r}: expected a single value")
        try:
            parsed[key] = fields[key].metadata["parse"](raw)
        except ValueError as exc:
            raise ConfigError(f"{label}: {key} has value {raw!r}: {exc}") from None
    defaults = {f.name: f.default for f in fields.values()}
    return InstanceSpec(
        name=name,
        model=parsed["model"],
        port=parsed["port"],
        gpu_memory=parsed.get("gpu_memory", defaults["gpu_memory"]),
        gpus=parsed.get("gpus", defaults["gpus"]),
        host=parsed.get("host", defaults["host"]),
        grpc_port=parsed.get("grpc_port"),
        settings=tuple((key, str(raw)) for key, raw in table.items() if key != "name"),
    )


def _check_unique(where: str, instances: Sequence[InstanceSpec]) -> None:
    names: dict[str, int] = {}
    ports: dict[int, str] = {}
    for number, instance in enumerate(instances, start=1):
        if instance.name in names:
            raise ConfigError(
                f"{where}: instances {names[instance.name]} and {number} are both named {instance.name!r}"
            )
        names[instance.name] = number
        if instance.port and instance.port == instance.grpc_port:
            raise ConfigError(f"{where}: instance {instance.name!r} asks for port {instance.port} for both HTTP and gRPC")
        for port in (instance.port, instance.grpc_port):
            if not port:
                continue  # off, or 0: each gets its own free port
            if port in ports:
                raise ConfigError(f"{where}: instances {ports[port]!r} and {instance.name!r} both ask for port {port}")
            ports[port] = instance.name


@dataclass(frozen=True)
class Placement:
    """One instance on one GPU (gpu None: no GPU is known, the instance may run on the CPU)."""

    instance: InstanceSpec
    gpu: Optional[int]
    cap_mib: Optional[int]  # what apply_policy will set; None for growth, greedy, or a share of an unknown total
    budget_mib: Optional[int]  # what it takes from the GPU's budget: cap + overhead (growth: overhead only)

    def cap_text(self) -> str:
        spec = self.instance.gpu_memory
        if spec.mode == "share":
            return f"{spec} = {self.cap_mib} MiB" if self.cap_mib is not None else f"{spec} of ?"
        if spec.mode == "cap":
            return f"{self.cap_mib} MiB"
        return spec.mode


@dataclass(frozen=True)
class GpuBudget:
    """One GPU's budget: what the instances on it need against what it has."""

    gpu: Gpu
    placements: tuple[Placement, ...]
    overhead_mib: int

    @property
    def caps_mib(self) -> int:
        return sum(p.cap_mib or 0 for p in self.placements)

    @property
    def needed_mib(self) -> int:
        return needed_mib((p.cap_mib for p in self.placements), self.overhead_mib)

    @property
    def fits(self) -> bool:
        return self.needed_mib <= self.gpu.available_mib

    def describe(self) -> str:
        gpu = self.gpu
        has = f"{gpu.available_mib} MiB available"
        if gpu.reserved_mib:
            has += f" ({gpu.total_mib} in all, {gpu.reserved_mib} reserved by the driver)"
        names = ", ".join(f"{p.instance.name} ({p.cap_text()})" for p in self.placements) or "none"
        return (
            f"GPU {gpu.index}{' (' + gpu.name + ')' if gpu.name else ''}: needs {self.needed_mib} MiB "
            f"(caps {self.caps_mib} + {len(self.placements)} x {self.overhead_mib} overhead) of {has}"
            f" -> {'fits' if self.fits else 'DOES NOT FIT'}; instances: {names}"
        )


@dataclass(frozen=True)
class Plan:
    """Where each instance runs, each GPU's budget, and what is wrong with the plan."""

    config: FleetConfig
    placements: tuple[Placement, ...]
    budgets: tuple[GpuBudget, ...]  # empty where no GPU is known
    warnings: tuple[str, ...]
    errors: tuple[str, ...]  # each one makes the plan unusable (exit 2)

    @property
    def fits(self) -> bool:
        return not self.errors

    def caps_for(self, name: str) -> dict[int, Optional[int]]:
        """Return the instance's cap per GPU index (None: no cap)."""
        return {p.gpu: p.cap_mib for p in self.placements if p.instance.name == name and p.gpu is not None}

    def cap_text(self, name: str) -> str:
        texts = [p.cap_text() + (f" on GPU {p.gpu}" if p.gpu is not None and len(self.budgets) > 1 else "")
                 for p in self.placements if p.instance.name == name]
        return ", ".join(texts) or "none (CPU)"

    def table(self) -> str:
        rows = [
            [p.instance.name, str(p.instance.port or "any"),
             "off" if p.instance.grpc_port is None else str(p.instance.grpc_port or "any"), p.instance.model,
             "-" if p.gpu is None else str(p.gpu), p.cap_text(),
             "-" if p.budget_mib is None else f"{p.budget_mib} MiB"]
            for p in self.placements
        ]
        return format_table(["instance", "port", "gRPC", "model", "GPU", "cap", "budget"], rows)


def make_plan(config: FleetConfig, gpus: Optional[Sequence[Gpu]]) -> Plan:
    """Place every instance on the GPUs it may use and check each GPU's budget.

    `gpus` None means no GPU is known (no NVML and no --gpu-total-mib): the caps are not checked
    against anything, but greedy sharing and the instances' own settings still are.
    """
    overhead = config.gpu_overhead_mib
    warnings: list[str] = []
    errors: list[str] = []
    placements: list[Placement] = []
    by_index = {g.index: g for g in gpus} if gpus is not None else None

    for instance in config.instances:
        spec = instance.gpu_memory
        if spec.mode == "growth":
            warnings.append(
                f"instance {instance.name!r} uses memory growth: its GPU memory is unbounded (it grows under "
                "load and is never given back); the budget counts only its overhead"
            )
        if instance.gpus == ():
            placements.append(Placement(instance, None, None, None))
            continue
        if by_index is None:
            cap = spec.cap_mib if spec.mode == "cap" else None
            placements.append(Placement(instance, None, cap, None if cap is None else cap + overhead))
            continue
        wanted = sorted(by_index) if instance.gpus is None else list(instance.gpus)
        for index in wanted:
            gpu = by_index.get(index)
            if gpu is None:
                errors.append(
                    f"instance {instance.name!r} asks for GPU {index}, but the plan has GPU(s) "
                    f"{', '.join(str(i) for i in sorted(by_index)) or 'none'}"
                )
                continue
            cap = cap_mib(spec, gpu)
            if spec.mode == "cap" and cap > gpu.available_mib:
                errors.append(
                    f"instance {instance.name!r} asks for a cap of {cap} MiB, more than GPU {index}'s "
                    f"{gpu.available_mib} MiB"
                )
            budget = None if spec.mode == "greedy" else (cap or 0) + overhead
            placements.append(Placement(instance, index, cap, budget))

    budgets = []
    for index in sorted(by_index or {}):
        on_gpu = tuple(p for p in placements if p.gpu == index)
        if not on_gpu:
            continue
        greedy = [p.instance.name for p in on_gpu if p.instance.gpu_memory.mode == "greedy"]
        if greedy and len(on_gpu) > 1:
            errors.append(
                f"instance {greedy[0]!r} is greedy (TensorFlow maps nearly all of the GPU at start) but shares "
                f"GPU {index} with {', '.join(repr(p.instance.name) for p in on_gpu if p.instance.name != greedy[0])};"
                " it would starve them: give it a cap or a share"
            )
            continue
        if greedy:
            continue  # alone on its GPU: it takes it all, which is fine
        budget = GpuBudget(by_index[index], on_gpu, overhead)
        budgets.append(budget)
        free = budget.gpu.available_mib - budget.gpu.in_use_mib
        if budget.fits and budget.gpu.in_use_mib and budget.needed_mib > free:
            warnings.append(
                f"GPU {index} has {budget.gpu.in_use_mib} MiB in use by other processes now: the plan fits the GPU "
                f"but not the {free} MiB free at the moment"
            )
        if not budget.fits:
            errors.append(
                f"GPU {index} is over budget: the plan needs {budget.needed_mib} MiB (caps {budget.caps_mib} MiB "
                f"+ {len(on_gpu)} x {overhead} MiB overhead) but {budget.gpu.available_mib} MiB are available; "
                f"instances on GPU {index}: "
                + ", ".join(f"{p.instance.name} ({p.cap_text()})" for p in on_gpu)
            )

    if by_index is None:
        _greedy_without_gpus(config, errors)
    return Plan(config, tuple(placements), tuple(budgets), tuple(warnings), tuple(errors))


def _greedy_without_gpus(config: FleetConfig, errors: list[str]) -> None:
    # Without a GPU inventory, two instances share a GPU if their GPU lists may overlap.
    for instance in config.instances:
        if instance.gpu_memory.mode != "greedy" or instance.gpus == ():
            continue
        mine = None if instance.gpus is None else set(instance.gpus)
        for other in config.instances:
            if other is instance or other.gpus == ():
                continue
            theirs = None if other.gpus is None else set(other.gpus)
            if mine is None or theirs is None or mine & theirs:
                errors.append(
                    f"instance {instance.name!r} is greedy (TensorFlow maps nearly all of the GPU at start) but may "
                    f"share a GPU with {other.name!r}; it would starve it: give it a cap or a share"
                )
                break


def planning_gpus(config: FleetConfig, total_mib: int) -> list[Gpu]:
    """Return the GPUs to plan on for `--gpu-total-mib`: GPU 0 and every GPU an instance names."""
    indices = {0}
    for instance in config.instances:
        indices.update(instance.gpus or ())
    return [Gpu(index=i, total_mib=total_mib) for i in sorted(indices)]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Lay rows out in left-aligned columns under their headers."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in [headers, *rows]]
    return "\n".join(lines)
