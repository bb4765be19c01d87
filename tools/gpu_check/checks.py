"""Check the service's GPU claims against a real GPU: `scripts/gpu-check [--out DIR]`.

On one GPU (--gpu, default 0) it starts holder processes (tools/gpu_check/holder.py, through CuPy or
PyTorch): one with a bare CUDA context, then one per --sizes-mib (default 2048 and 5120), each waiting
until it is told to exit. Against them it checks:

1. the overhead of a bare CUDA context, as NVML sees it per process (or as the rise of the device's
   used memory, where NVML cannot see the holders' pids), against the fleet's default
   gpu_overhead_mib; and again after a cuBLAS and a cuDNN call (a warning if over);
2. the NVML module (app/gpu/nvml.py): each holder's used MiB is its allocation plus at most a context,
   and the device's total, used and free MiB and driver are what `nvidia-smi --query-gpu` prints;
3. the /gpu accounting (app/gpu/report.py) over a fleet state file that names two holders as
   instances capped at their allocations: each is named, its overhead is NVML used - cap, the bare
   context is `other`, and the memory held unused is used - TensorFlow's current - overhead (no
   TensorFlow here: half the cap stands in for its current use). Where NVML lists no holder pid (a
   container without --pid=host), it checks the documented fallback to TensorFlow's figures instead;
4. the fleet budget (app/fleet/plan.py) against NVML's total: the holders' fleet, one filled to
   exactly the total and one a MiB over, through `python -m app fleet --dry-run --gpu-total-mib`
   (exit 0, 0, 2) and through the planner on NVML's inventory (total less what the driver reserves);
5. release: each holder is ended, and its memory must be back in NVML's free figure within 5 s
   (what idle unloading relies on), and all of it by the end;
6. precision, where TensorFlow is installed (tools/gpu_check/precision.py): auto chooses fp16 on tensor
   cores, fp16 passes the parity gate, and runs faster than fp32; without TensorFlow, a skip that says so;
7. worker groups, where TensorFlow is installed (tools/gpu_check/groups.py): a real server's group of two models
   runs in one process, which NVML lists once on the GPU (one context); without TensorFlow, a skip.

It writes gpu-check.json (every figure and check), gpu-check.txt (the table it prints) and
gpu-report.json (the /gpu report it judged) to --out (default out/gpu-check), with the holders' logs
and the fleet files it planned.
Exit status: 0 every claim holds (warnings and skips are named), 1 a claim does not hold, 2 it
cannot run here (no NVML, no GPU, neither CuPy nor PyTorch, or no holder can use the GPU).

It needs python3 (3.11 or later), nvidia-ml-py, and CuPy or PyTorch with CUDA; of the project it imports
only the modules in the block below, which import the standard library and pynvml and nothing else
(no Flask, Twisted or TensorFlow). A pure-Python wheel put in .whl/ goes on the path (scripts/gpu-check
does that), e.g. nvidia_ml_py-*.whl for a machine without nvidia-ml-py.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

# Every project module this check uses, in one place. Each imports only the standard library and pynvml.
from app.errors import NvmlUnavailable
from app.fleet.cli import gpu_inventory
from app.fleet.plan import FleetConfig, Plan, load_fleet, make_plan
from app.fleet.state import OTHER
from app.gpu.nvml import DeviceSnapshot, Nvml, ProcessUsage
from app.gpu.report import PID_NOT_VISIBLE, GpuReport
from tools import ROOT

HOLDER = Path(__file__).resolve().parent / "holder.py"  # run by path: it imports nothing of the project

PASS, FAIL, WARN, SKIP = "pass", "fail", "warn", "skip"
BACKENDS = ("torch", "cupy")  # auto tries them in this order: torch's context is more like TensorFlow's
DEFAULT_SIZES_MIB = (2048, 5120)
DEFAULT_OVERHEAD_MIB = next(f.default for f in dataclasses.fields(FleetConfig) if f.name == "gpu_overhead_mib")
SLACK_MIB = 64  # per process: allocator rounding and the CUDA runtime's own small allocations
SMI_SLACK_MIB = 8  # nvidia-smi reads the device a moment after NVML does
RELEASE_LIMIT_S = 5.0  # "back within a few seconds"
RELEASE_WAIT_S = 15.0  # how long to keep looking after that, to report how late it was
READY_TIMEOUT_S = 180.0  # a cold import of torch and its CUDA libraries can take a minute
EXIT_TIMEOUT_S = 15.0
NEEDS = "it needs an NVIDIA GPU with its driver, nvidia-ml-py, and CuPy or PyTorch"


class CannotRun(Exception):
    """The check cannot run on this machine (exit 2)."""


class HolderFailed(CannotRun):
    """A holder could not use the GPU, or stopped answering."""


@dataclass
class Check:
    """One claim and whether it held, with the figures it was judged on."""

    name: str
    outcome: str  # pass | fail | warn | skip
    detail: str
    figures: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Named:
    """A holder as the fleet state file names it: an instance capped at what it allocated."""

    name: str
    pid: int
    cap_mib: int


# --- the checks: pure functions of NVML snapshots and the service's own answers ----------------------------

def find_process(device: DeviceSnapshot, pid: int) -> Optional[ProcessUsage]:
    return next((p for p in device.processes if p.pid == pid), None)


def pid_visibility(device: DeviceSnapshot, pids: Sequence[int]) -> tuple[bool, str]:
    """Return whether NVML lists every holder's pid on the device, and what it lists instead."""
    listed = sorted(p.pid for p in device.processes)
    missing = [pid for pid in pids if pid not in listed]
    if not missing:
        return True, f"NVML lists every holder's pid on GPU {device.index}"
    if not listed:
        return False, (f"NVML lists no compute process on GPU {device.index} while the holders hold memory "
                       "(this container runtime hides them)")
    return False, (f"NVML lists pid(s) {', '.join(map(str, listed))} on GPU {device.index} but not holder pid(s) "
                   f"{', '.join(map(str, missing))}: in a container NVML reports host pids unless it runs with "
                   "--pid=host")


def check_holder_gpu(device: DeviceSnapshot, uuids: dict[str, Optional[str]]) -> Check:
    """Every holder runs on the GPU that NVML numbers --gpu, by the uuid its backend reports (None: not told)."""
    label = f"holders: on GPU {device.index}, by uuid"
    own = device.uuid.lower().removeprefix("gpu-")
    wrong = [f"{name} on {uuid}" for name, uuid in uuids.items() if uuid is not None and uuid != own]
    told = [name for name, uuid in uuids.items() if uuid is not None]
    if wrong:
        return Check(label, FAIL, f"GPU {device.index} is {device.uuid}, but " + ", ".join(wrong)
                     + " (CUDA_VISIBLE_DEVICES renumbers CUDA's devices: unset it)")
    if not told:
        return Check(label, SKIP, "the backend does not report its device's uuid")
    return Check(label, PASS, f"{len(told)} holder(s) on {device.uuid}")


def check_holder_used(name: str, device: DeviceSnapshot, pid: int, allocated_mib: int,
                      context_mib: Optional[int]) -> Check:
    """A holder's NVML used MiB is its allocation plus at most a CUDA context (and the slack)."""
    label = f"nvml: {name} used = allocation + context"
    process = find_process(device, pid)
    if process is None:
        return Check(label, FAIL, f"NVML does not list pid {pid}")
    if process.used_mib is None:
        return Check(label, SKIP, f"NVML lists pid {pid} but cannot attribute memory to it")
    context = DEFAULT_OVERHEAD_MIB if context_mib is None else context_mib
    high = allocated_mib + context + SLACK_MIB
    ok = allocated_mib <= process.used_mib <= high
    return Check(label, PASS if ok else FAIL,
                 f"{process.used_mib} MiB used for {allocated_mib} MiB allocated; expected {allocated_mib} to {high} "
                 f"(+ context {context} + {SLACK_MIB} slack)",
                 {"pid": pid, "used_mib": process.used_mib, "allocated_mib": allocated_mib, "context_mib": context})


def check_device_rise(name: str, rise_mib: int, allocated_mib: int, context_mib: Optional[int]) -> Check:
    """Without per-pid figures: the device's used MiB rose by the allocation plus at most a context."""
    context = DEFAULT_OVERHEAD_MIB if context_mib is None else context_mib
    high = allocated_mib + context + SLACK_MIB
    ok = allocated_mib <= rise_mib <= high
    return Check(f"nvml: {name} device used rose by allocation + context", PASS if ok else FAIL,
                 f"device used rose {rise_mib} MiB for {allocated_mib} MiB allocated; "
                 f"expected {allocated_mib} to {high}",
                 {"rise_mib": rise_mib, "allocated_mib": allocated_mib, "context_mib": context})


def check_context_overhead(context_mib: Optional[int], source: str, default_mib: int = DEFAULT_OVERHEAD_MIB) -> Check:
    """A bare CUDA context fits in the fleet's default gpu_overhead_mib."""
    label = "overhead: bare CUDA context <= default gpu_overhead_mib"
    if context_mib is None:
        return Check(label, SKIP, "no figure: NVML neither lists the holder nor shows the device's memory rise")
    ok = context_mib <= default_mib
    return Check(label, PASS if ok else FAIL,
                 f"{context_mib} MiB per process ({source}); the fleet budgets {default_mib} MiB"
                 + ("" if ok else ": the default is too small even for an empty process"),
                 {"context_mib": context_mib, "source": source, "default_mib": default_mib})


def check_libraries_overhead(libs_mib: Optional[int], loaded: Sequence[str], source: str,
                             default_mib: int = DEFAULT_OVERHEAD_MIB) -> Check:
    """A context with cuBLAS (and cuDNN) loaded, as a model's first call loads them: a warning if over the default."""
    label = f"overhead: context + {' + '.join(loaded) or 'libraries'} <= default gpu_overhead_mib"
    if libs_mib is None:
        return Check(label, SKIP, "no figure", {"loaded": list(loaded)})
    ok = libs_mib <= default_mib
    return Check(label, PASS if ok else WARN,
                 f"{libs_mib} MiB per process ({source}); the fleet budgets {default_mib} MiB"
                 + ("" if ok else "; TensorFlow loads these too: measure with `python -m app calibrate`"),
                 {"libs_mib": libs_mib, "loaded": list(loaded), "source": source, "default_mib": default_mib})


SMI_FIELDS = ("index", "memory.total", "memory.used", "memory.free", "driver_version")


def parse_nvidia_smi(text: str) -> dict[int, dict]:
    """Parse `nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits`; raise ValueError if it is not that."""
    rows = {}
    for line in text.strip().splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(SMI_FIELDS):
            raise ValueError(f"expected {len(SMI_FIELDS)} fields, got {line!r}")
        rows[int(cells[0])] = {"total_mib": int(cells[1]), "used_mib": int(cells[2]), "free_mib": int(cells[3]),
                               "driver_version": cells[4]}
    return rows


def check_device_totals(device: DeviceSnapshot, driver_version: str, smi: Optional[dict],
                        smi_error: Optional[str] = None) -> Check:
    """NVML's total, used and free MiB and driver version are what nvidia-smi prints."""
    label = "nvml: device totals = nvidia-smi"
    if smi is None:
        return Check(label, SKIP, smi_error or "nvidia-smi printed nothing for this GPU")
    reserved = device.memory_reserved_mib or 0
    # nvidia-smi's used leaves out what the driver reserves on recent drivers, as memory info v2 does.
    used_forms = {"used": device.memory_used_mib, "used + reserved": device.memory_used_mib + reserved}
    used_form = next((k for k, v in used_forms.items() if abs(smi["used_mib"] - v) <= SMI_SLACK_MIB), None)
    problems = []
    if smi["total_mib"] != device.memory_total_mib:
        problems.append(f"total {device.memory_total_mib} vs {smi['total_mib']}")
    if used_form is None:
        problems.append(f"used {device.memory_used_mib} (+ reserved {reserved}) vs {smi['used_mib']}")
    if abs(smi["free_mib"] - device.memory_free_mib) > SMI_SLACK_MIB:
        problems.append(f"free {device.memory_free_mib} vs {smi['free_mib']}")
    if smi["driver_version"] != driver_version:
        problems.append(f"driver {driver_version} vs {smi['driver_version']}")
    figures = {"nvml": {"total_mib": device.memory_total_mib, "used_mib": device.memory_used_mib,
                        "free_mib": device.memory_free_mib, "reserved_mib": device.memory_reserved_mib,
                        "driver_version": driver_version},
               "nvidia_smi": smi, "used_matches": used_form}
    if problems:
        return Check(label, FAIL, "NVML vs nvidia-smi: " + "; ".join(problems), figures)
    return Check(label, PASS, f"total {device.memory_total_mib} MiB, used {smi['used_mib']} (NVML's {used_form}), "
                              f"free {smi['free_mib']}, driver {driver_version}", figures)


def check_accounting(report: dict, gpu: int, named: Sequence[Named], me: Named, tf_current_mib: float,
                     bystander_pid: int, visible: bool) -> list[Check]:
    """Judge /gpu's accounting: holders named as workers with overhead = used - cap, or the documented fallback."""
    accounting = report["accounting"]
    rows = {r["pid"]: r for g in accounting["gpus"] if g["index"] == gpu for r in g["processes"]}
    nvml_used = {p["pid"]: p["used_mib"] for d in report.get("devices", []) if d["index"] == gpu
                 for p in d["processes"]}
    (this,) = [w for w in accounting["workers"] if w["pid"] == me.pid] or [None]
    (mine,) = [row for row in (this or {}).get("gpus", []) if row["index"] == gpu] or [None]
    checks = []
    if not visible:
        holder_rows = [r for r in rows.values() if r["owner"] != OTHER]
        ok = (this is not None and this["pid_visible"] is False and this["source"] == "tensorflow"
              and this["note"] == PID_NOT_VISIBLE.format(pid=me.pid) and not holder_rows
              and mine is not None and mine["used_mib"] is None
              and mine["held_unused_mib"] == round(me.cap_mib - tf_current_mib, 1))
        return [Check("accounting: falls back to TensorFlow's figures where NVML hides the pids", PASS if ok else FAIL,
                      f"worker {me.name}: pid_visible {this and this['pid_visible']}, source {this and this['source']}, "
                      f"held unused {mine and mine['held_unused_mib']} MiB (cap - current "
                      f"{me.cap_mib - tf_current_mib:g}); {len(rows)} process(es) listed, {len(holder_rows)} named",
                      {"worker": this, "processes": list(rows.values())})]
    for holder in named:
        row = rows.get(holder.pid)
        used = nvml_used.get(holder.pid)
        expected = None if used is None or used < holder.cap_mib else used - holder.cap_mib
        ok = (row is not None and row["owner"] == "worker" and row["model"] == holder.name
              and row["cap_mib"] == holder.cap_mib and row["used_mib"] == used and expected is not None
              and row["overhead_mib"] == expected)
        checks.append(Check(f"accounting: {holder.name} named, overhead = used - cap", PASS if ok else FAIL,
                            f"row {row and {k: row[k] for k in ('owner', 'model', 'used_mib', 'cap_mib', 'overhead_mib')}}"
                            f"; expected overhead {expected}", {"row": row}))
    row = rows.get(bystander_pid)
    ok = row is not None and row["owner"] == OTHER and row["cap_mib"] is None and row["overhead_mib"] is None
    checks.append(Check("accounting: a process of no worker is 'other'", PASS if ok else FAIL,
                        f"row {row}", {"row": row}))
    used = nvml_used.get(me.pid)
    overhead = None if used is None else used - me.cap_mib
    ok = (this is not None and this["pid_visible"] is True and this["source"] == "nvml" and mine is not None
          and mine["used_mib"] == used and mine["overhead_from"] == "NVML used - cap" and mine["overhead_mib"] == overhead
          and overhead is not None and mine["held_unused_mib"] == round(used - tf_current_mib - overhead, 1))
    checks.append(Check("accounting: held unused = used - TF current - overhead", PASS if ok else FAIL,
                        f"{me.name}: used {mine and mine['used_mib']}, overhead {mine and mine['overhead_mib']} "
                        f"({mine and mine['overhead_from']}), held unused {mine and mine['held_unused_mib']} MiB "
                        f"with TF current {tf_current_mib:g} (stand-in)", {"worker": this}))
    return checks


def check_plan(label: str, plan: Plan, gpu: int, caps: Sequence[int], overhead: int, available_mib: int) -> Check:
    """The planner's budget for the GPU: needed = caps + one overhead each, against the available MiB."""
    budget = next((b for b in plan.budgets if b.gpu.index == gpu), None)
    needed = sum(caps) + len(caps) * overhead
    fits = needed <= available_mib
    figures = {"needed_mib": needed, "available_mib": available_mib, "fits": fits, "caps_mib": list(caps),
               "overhead_mib": overhead}
    if budget is None:
        return Check(label, FAIL, f"the plan has no budget for GPU {gpu}", figures)
    ok = (budget.needed_mib == needed and budget.gpu.available_mib == available_mib and budget.fits == fits
          and plan.fits == fits)
    return Check(label, PASS if ok else FAIL,
                 f"plan: needs {budget.needed_mib} of {budget.gpu.available_mib} MiB, "
                 f"{'fits' if plan.fits else 'does not fit'}; expected {needed} of {available_mib}, "
                 f"{'fits' if fits else 'does not fit'}", figures)


def check_dry_run(label: str, returncode: int, stdout: str, stderr: str, needed_mib: int, fits: bool) -> Check:
    """`python -m app fleet --dry-run` exits 0 for a plan that fits, 2 for one that does not, naming the MiB needed."""
    ok = (returncode == (0 if fits else 2) and f"needs {needed_mib} MiB" in stdout
          and (fits or "over budget" in stderr))
    return Check(label, PASS if ok else FAIL,
                 f"exit {returncode} (expected {0 if fits else 2}), needs {needed_mib} MiB "
                 f"{'printed' if f'needs {needed_mib} MiB' in stdout else 'NOT printed'}",
                 {"returncode": returncode, "stdout": stdout[-2000:], "stderr": stderr[-2000:]})


def release_target(free_before_mib: int, held_mib: int) -> int:
    """The free MiB that shows a holder's memory is back: what was free plus what it held, less the slack."""
    return free_before_mib + held_mib - SLACK_MIB


def check_release(name: str, held_mib: int, free_before_mib: int, samples: Sequence[tuple[float, int]],
                  limit_s: float) -> Check:
    """A holder's memory is back in NVML's free figure within limit_s of its exit; samples are (s, free MiB)."""
    target = release_target(free_before_mib, held_mib)
    first = next((t for t, free in samples if free >= target), None)
    ok = first is not None and first <= limit_s
    if first is None:
        last = samples[-1] if samples else (0.0, free_before_mib)
        detail = (f"{held_mib} MiB not back after {last[0]:.1f} s: free {last[1]} MiB, expected at least {target}")
    else:
        detail = f"{held_mib} MiB back in NVML's free figure {first:.2f} s after exit (limit {limit_s:g} s)"
    return Check(f"release: {name}", PASS if ok else FAIL, detail,
                 {"held_mib": held_mib, "free_before_mib": free_before_mib, "target_free_mib": target,
                  "release_s": first, "samples": len(samples)})


def check_all_back(baseline: DeviceSnapshot, final: DeviceSnapshot) -> Check:
    """After every holder has ended, the device's used MiB is back where it started."""
    ok = final.memory_used_mib <= baseline.memory_used_mib + SLACK_MIB
    return Check("release: device back to its baseline", PASS if ok else FAIL,
                 f"used {final.memory_used_mib} MiB, {baseline.memory_used_mib} before the holders",
                 {"baseline_used_mib": baseline.memory_used_mib, "final_used_mib": final.memory_used_mib})


# --- the holders: child processes, driven from the main thread only -----------------------------------------

class Holder:
    """One tools/gpu_check/holder.py process; its stdout is read by a thread into a queue, all else is the caller's."""

    def __init__(self, name: str, mib: int, backend: str, gpu: int, log_dir: Path, holder_script: Path):
        self.name, self.mib, self.backend = name, mib, backend
        self.log_path = log_dir / f"{name}.log"
        self.lines: queue.Queue = queue.Queue()
        env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", PYTHONUNBUFFERED="1")
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(holder_script), "--backend", backend, "--device", str(gpu), "--mib", str(mib)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
        self.pid = self.process.pid
        self.ready: dict = {}
        threading.Thread(target=self._read, name=f"holder-{name}", daemon=True).start()

    def _read(self) -> None:
        with self.process.stdout:
            for line in self.process.stdout:
                self.lines.put(line)
        self.lines.put(None)

    def expect(self, event: str, timeout_s: float = READY_TIMEOUT_S) -> dict:
        """Wait for the holder's next message of this event; raise HolderFailed if it fails, exits or is silent."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise HolderFailed(f"holder {self.name} did not report {event!r} within {timeout_s:g} s "
                                   f"(log: {self.log_path})") from None
            if line is None:
                raise HolderFailed(f"holder {self.name} exited ({self.process.wait()}) before reporting {event!r} "
                                   f"(log: {self.log_path})")
            try:
                message = json.loads(line)
            except ValueError:
                continue  # a library printed to stdout
            if message.get("event") == "failed":
                raise HolderFailed(f"holder {self.name} ({self.backend}) cannot use the GPU: {message.get('error')}")
            if message.get("event") == event:
                return message

    def tell(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def end(self) -> bool:
        """Tell it to exit and wait; kill it if it does not. Return whether it exited by itself."""
        try:
            self.tell("exit")
        except (BrokenPipeError, OSError, ValueError):
            pass
        self._close_stdin()
        try:
            self.process.wait(EXIT_TIMEOUT_S)
            return True
        except subprocess.TimeoutExpired:
            self.kill()
            return False

    def kill(self) -> None:
        """Kill it if it still runs, and close its stdin."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close_stdin()

    def _close_stdin(self) -> None:
        try:
            self.process.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # it has exited with input unread


def pick_backends(choice: str) -> list[str]:
    """Return the backends to try, installed ones only; raise CannotRun where there is none."""
    wanted = BACKENDS if choice == "auto" else (choice,)
    found = [name for name in wanted if importlib.util.find_spec(name) is not None]
    if not found:
        raise CannotRun("neither PyTorch nor CuPy is installed" if choice == "auto" else f"{choice} is not installed")
    return found


def open_gpu(gpu: int, nvml_library=None) -> Nvml:
    """Open NVML and make sure it has the GPU; raise CannotRun saying why not."""
    try:
        nvml = Nvml.open(nvml_library)
        count = nvml.device_count()
    except NvmlUnavailable as exc:
        raise CannotRun(exc.message) from None
    if count == 0:
        raise CannotRun("NVML sees no GPU")
    if gpu >= count:
        raise CannotRun(f"there is no GPU {gpu}: NVML sees {count}, indices 0 to {count - 1}")
    return nvml


# --- the run ---------------------------------------------------------------------------------------------

class Run:
    """One check run on one GPU: owns the holders and every figure; used from the main thread only."""

    def __init__(self, nvml: Nvml, gpu: int, backends: Sequence[str], sizes_mib: Sequence[int], out: Path,
                 nvidia_smi: str = "nvidia-smi", nvml_library=None, holder_script: Path = HOLDER):
        self.nvml, self.gpu, self.backends, self.sizes = nvml, gpu, list(backends), list(sizes_mib)
        self.out, self.nvidia_smi, self.nvml_library, self.holder_script = out, nvidia_smi, nvml_library, holder_script
        self.checks: list[Check] = []
        self.holders: list[Holder] = []
        self.measured: dict = {"holders": []}
        self.backend = ""

    def snap(self) -> DeviceSnapshot:
        (device,) = self.nvml.snapshot([self.gpu])
        return device

    def start(self, name: str, mib: int, backend: str) -> tuple[Holder, DeviceSnapshot, DeviceSnapshot]:
        """Start a holder and wait for it; return it with the device before and after."""
        before = self.snap()
        holder = Holder(name, mib, backend, self.gpu, self.out / "holders", self.holder_script)
        self.holders.append(holder)
        holder.ready = holder.expect("ready")
        if holder.ready.get("pid") != holder.pid:
            raise HolderFailed(f"holder {name} says it is pid {holder.ready.get('pid')}, but it was started as "
                               f"{holder.pid}")
        return holder, before, self.snap()

    def start_context(self) -> tuple[Holder, DeviceSnapshot, DeviceSnapshot]:
        """Start the bare-context holder with the first backend that can use the GPU; later holders use the same."""
        failures = []
        for backend in self.backends:
            try:
                started = self.start("context", 0, backend)
                self.backend = backend
                return started
            except HolderFailed as exc:
                failures.append(str(exc))
                self.holders.pop().kill()
        raise HolderFailed("; ".join(failures))

    def run(self) -> dict:
        (self.out / "holders").mkdir(parents=True, exist_ok=True)
        try:
            return self._run()
        finally:
            for holder in self.holders:
                holder.kill()

    def _run(self) -> dict:
        baseline = self.snap()
        driver, cuda = self.nvml.driver_version(), self.nvml.cuda_driver_version()
        needed = sum(self.sizes) + (len(self.sizes) + 1) * (DEFAULT_OVERHEAD_MIB + SLACK_MIB)
        if baseline.memory_free_mib < needed:
            raise CannotRun(f"GPU {self.gpu} has {baseline.memory_free_mib} MiB free; the holders need {needed}")

        context, before, after = self.start_context()
        context_rise = after.memory_used_mib - before.memory_used_mib
        context_process = find_process(after, context.pid)
        context_used = context_process.used_mib if context_process is not None else None
        named, rises = [], {}
        for number, mib in enumerate(self.sizes, start=1):
            holder, before, after = self.start(f"h{number}-{mib}MiB", mib, self.backend)
            rises[holder.name] = after.memory_used_mib - before.memory_used_mib
            named.append(Named(holder.name, holder.pid, mib))
        loaded = self.snap()
        visible, visibility = pid_visibility(loaded, [h.pid for h in self.holders])
        self.checks.append(Check("nvml: holders' pids listed", PASS if visible else WARN, visibility,
                                 {"listed": [dataclasses.asdict(p) for p in loaded.processes]}))
        if visible and context_used is not None:
            context_mib, source = context_used, "NVML per-process used"
        else:
            context_mib, source = context_rise, "rise of the device's used memory"
        self.measured.update(context_overhead_mib=context_mib, context_overhead_from=source,
                             context_pid_used_mib=context_used, context_device_rise_mib=context_rise)

        self.checks.append(check_holder_gpu(loaded, {h.name: h.ready.get("uuid") for h in self.holders}))
        for holder in self.holders[1:]:
            used = find_process(loaded, holder.pid)
            self.measured["holders"].append({"name": holder.name, "pid": holder.pid, "allocated_mib": holder.mib,
                                             "pid_used_mib": used and used.used_mib,
                                             "device_rise_mib": rises[holder.name]})
            if visible:
                self.checks.append(check_holder_used(holder.name, loaded, holder.pid, holder.mib, context_mib))
            else:
                self.checks.append(check_device_rise(holder.name, rises[holder.name], holder.mib, context_mib))
        self.checks.append(self.check_smi(loaded, driver))
        self.checks.extend(self.check_accounting(named, context.pid, visible))
        self.checks.append(check_context_overhead(context_mib, source))
        self.check_libraries(context, visible, context_mib)
        self.checks.extend(self.check_fleet(named, loaded))
        self.release(visible)
        self.checks.append(check_all_back(baseline, self.snap()))
        return {
            "backend": {"name": self.backend, "version": context.ready.get("version")},
            "gpu": {"index": self.gpu, "name": baseline.name, "uuid": baseline.uuid,
                    "total_mib": baseline.memory_total_mib, "reserved_mib": baseline.memory_reserved_mib,
                    "used_mib_before": baseline.memory_used_mib,
                    "processes_before": [dataclasses.asdict(p) for p in baseline.processes]},
            "driver_version": driver, "cuda_driver_version": cuda,
            "pids_visible": visible, "pids_note": visibility,
            "default_gpu_overhead_mib": DEFAULT_OVERHEAD_MIB, "slack_mib": SLACK_MIB,
            "measured": self.measured,
        }

    def check_smi(self, device: DeviceSnapshot, driver: str) -> Check:
        path = shutil.which(self.nvidia_smi)
        if path is None:
            return check_device_totals(device, driver, None, f"{self.nvidia_smi} is not on the PATH")
        command = [path, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits", "-i", str(self.gpu)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
            rows = parse_nvidia_smi(done.stdout) if done.returncode == 0 else {}
            error = None if done.returncode == 0 else f"nvidia-smi exited {done.returncode}: {done.stderr.strip()}"
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            rows, error = {}, f"nvidia-smi: {exc}"
        return check_device_totals(device, driver, rows.get(self.gpu), error)

    def check_accounting(self, named: Sequence[Named], bystander_pid: int, visible: bool) -> list[Check]:
        """Run /gpu's report as a server whose model workers are the holders, each capped at its allocation."""
        me = named[0]
        tf_current = me.cap_mib / 2  # no TensorFlow here: a model using half its cap stands in for its figure
        total = self.snap().memory_total_mib
        workers = [
            {"pid": n.pid, "model": n.name, "version": "1", "caps_mib": {self.gpu: n.cap_mib},
             "policy": {"mode": "cap", "spec": f"{n.cap_mib}MiB", "note": None,
                        "gpus": [{"index": self.gpu, "cap_mib": n.cap_mib, "total_mib": total}]},
             "tensorflow": [{"device": "/device:GPU:0", "current_mib": tf_current, "peak_mib": tf_current}]}
            for n in named
        ]
        report = GpuReport(self.nvml, selected=(self.gpu,), workers=lambda: workers, pid=os.getpid()).to_json()
        (self.out / "gpu-report.json").write_text(json.dumps(report, indent=1) + "\n")
        return check_accounting(report, self.gpu, named, me, tf_current, bystander_pid, visible)

    def check_libraries(self, context: Holder, visible: bool, context_mib: int) -> None:
        """Have the bare-context holder load cuBLAS (and cuDNN) and measure it again."""
        before = self.snap()
        try:
            context.tell("libs")
            libraries = context.expect("libs", 120.0).get("loaded", [])
        except (HolderFailed, OSError) as exc:
            self.checks.append(check_libraries_overhead(None, [], str(exc)))
            return
        after = self.snap()
        process = find_process(after, context.pid)
        if visible and process is not None and process.used_mib is not None:
            libs_mib, source = process.used_mib, "NVML per-process used"
        else:
            libs_mib, source = context_mib + after.memory_used_mib - before.memory_used_mib, \
                "rise of the device's used memory"
        self.measured.update(libs_overhead_mib=libs_mib, libs_loaded=libraries, libs_overhead_from=source)
        self.checks.append(check_libraries_overhead(libs_mib, libraries, source))

    def check_fleet(self, named: Sequence[Named], device: DeviceSnapshot) -> list[Check]:
        """Plan the holders' fleet, one filled to NVML's total and one a MiB over: by the CLI and the planner."""
        total, overhead = device.memory_total_mib, DEFAULT_OVERHEAD_MIB
        caps = [(n.name, n.cap_mib) for n in named]
        fill = total - sum(c for _, c in caps) - (len(caps) + 1) * overhead
        variants = {"holders": caps, "full": [*caps, ("fill", fill)], "over": [*caps, ("fill", fill + 1)]}
        env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
        runs = {}
        for label, instances in variants.items():
            path = self.out / f"fleet-{label}.toml"
            path.write_text(fleet_toml(instances, self.gpu))
            runs[label] = (path, subprocess.Popen(
                [sys.executable, "-m", "app", "fleet", "--config", str(path), "--dry-run",
                 "--gpu-total-mib", str(total)],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True))
        checks = []
        available = total - (device.memory_reserved_mib or 0)
        for label, (path, process) in runs.items():
            stdout, stderr = process.communicate(timeout=120)
            instance_caps = [c for _, c in variants[label]]
            needed = sum(instance_caps) + len(instance_caps) * overhead
            checks.append(check_dry_run(f"fleet: --dry-run --gpu-total-mib {total}, {label}", process.returncode,
                                        stdout, stderr, needed, needed <= total))
            config = load_fleet(path)
            gpus, reason = gpu_inventory(config, None, self.nvml_library)
            if gpus is None:
                checks.append(Check(f"fleet: plan on NVML's inventory, {label}", FAIL, f"no inventory: {reason}"))
                continue
            checks.append(check_plan(f"fleet: plan on NVML's inventory, {label}", make_plan(config, gpus), self.gpu,
                                     instance_caps, overhead, available))
        return checks

    def release(self, visible: bool) -> None:
        """End the holders, last started first, and time each one's memory back into NVML's free figure."""
        releases = {}
        for holder in reversed(self.holders):
            before = self.snap()
            process = find_process(before, holder.pid)
            if visible and process is not None and process.used_mib is not None:
                held = process.used_mib
            else:
                held = self._rise_of(holder)
            asked = time.monotonic()
            exited = holder.end()
            exit_s = time.monotonic() - asked
            samples = self.wait_for_free(release_target(before.memory_free_mib, held))
            check = check_release(holder.name, held, before.memory_free_mib, samples, RELEASE_LIMIT_S)
            if not exited:
                check.outcome, check.detail = FAIL, f"it did not exit within {EXIT_TIMEOUT_S:g} s and was killed; " \
                                                    + check.detail
            check.figures["exit_s"] = round(exit_s, 3)
            check.detail += f"; it took {exit_s:.2f} s to exit once told"
            releases[holder.name] = {"held_mib": held, "exit_s": round(exit_s, 3),
                                     "release_s": check.figures["release_s"]}
            self.checks.append(check)
        self.measured["release"] = releases

    def _rise_of(self, holder: Holder) -> int:
        if holder.name == "context":
            return self.measured.get("libs_overhead_mib") or self.measured["context_overhead_mib"]
        return next(h["device_rise_mib"] for h in self.measured["holders"] if h["name"] == holder.name)

    def wait_for_free(self, target_free_mib: int) -> list[tuple[float, int]]:
        start, samples = time.monotonic(), []
        while True:
            free = self.snap().memory_free_mib
            elapsed = time.monotonic() - start
            samples.append((round(elapsed, 3), free))
            if free >= target_free_mib or elapsed > RELEASE_LIMIT_S + RELEASE_WAIT_S:
                return samples
            time.sleep(0.05)


def fleet_toml(instances: Sequence[tuple[str, int]], gpu: int) -> str:
    """Write a fleet file with one capped instance per (name, cap MiB) on the GPU, gpu_overhead_mib left default."""
    tables = [f'[[instance]]\nname = "{name}"\nmodel = "models/faces"\nport = 0\ngpu_memory = "{cap}MiB"\n'
              f'gpus = "{gpu}"\n' for name, cap in instances]
    return "# written by scripts/gpu-check: its holders as a fleet, for --dry-run\n" + "\n".join(tables)


def table(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{c.outcome:<5} {c.name:<{width}}  {c.detail}" for c in checks)


def summary(checks: Sequence[Check]) -> str:
    counts = {outcome: sum(c.outcome == outcome for c in checks) for outcome in (PASS, FAIL, WARN, SKIP)}
    return f"{len(checks)} checks: " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items())


def check_gpu(argv: Sequence[str], out: Path, gpu: int, backends: Sequence[str], sizes_mib: Sequence[int],
              nvidia_smi: str = "nvidia-smi", nvml_library=None, holder_script: Path = HOLDER,
              tensorflow_child=None, group_server=None) -> tuple[int, dict]:
    """Open NVML, run every check on the GPU, write the report and the table; return the exit status and the report.

    `tensorflow_child(gpu)` gives the precision check's figures (tools/gpu_check/precision.py; default: its child
    process, where TensorFlow is installed); `group_server(gpu)` the worker-group check's (tools/gpu_check/groups.py;
    default: a real server, where TensorFlow is installed).
    """
    from tools.gpu_check.groups import group_checks
    from tools.gpu_check.precision import precision_checks

    nvml = open_gpu(gpu, nvml_library)
    try:
        run = Run(nvml, gpu, backends, sizes_mib, out, nvidia_smi, nvml_library, holder_script)
        started = time.time()
        figures = run.run()
    except NvmlUnavailable as exc:
        raise CannotRun(f"NVML failed during the check: {exc.message}") from None
    finally:
        nvml.close()
    run.checks.extend(precision_checks(gpu, tensorflow_child))  # after the holders: the GPU is the child's alone
    run.checks.extend(group_checks(gpu, group_server))  # then a server's alone
    failed = any(c.outcome == FAIL for c in run.checks)
    report = {
        "tool": "scripts/gpu-check", "command": " ".join(["scripts/gpu-check", *argv]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1), "host": platform.node(), "python": platform.python_version(),
        **figures, "checks": [dataclasses.asdict(c) for c in run.checks], "result": FAIL if failed else PASS,
    }
    gpu_info = figures["gpu"]
    text = (f"gpu-check: {gpu_info['name']} (GPU {gpu}, {gpu_info['total_mib']} MiB), "
            f"driver {figures['driver_version']}"
            f" (CUDA {figures['cuda_driver_version']}), {figures['backend']['name']} {figures['backend']['version']}; "
            f"a bare context {figures['measured']['context_overhead_mib']} MiB per process\n"
            + table(run.checks) + f"\n{summary(run.checks)}: {report['result']}")
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu-check.txt").write_text(text + "\n")
    print(text)
    print(f"report: {out / 'gpu-check.json'}")
    return (1 if failed else 0), report


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(size <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"expected MiB above 0, comma-separated, like 2048,5120, not {text!r}")
    return sizes


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "gpu-check", help="output folder")
    parser.add_argument("--gpu", type=int, default=0, help="GPU index, as nvidia-smi numbers it (default 0)")
    parser.add_argument("--backend", choices=("auto", *BACKENDS), default="auto",
                        help="what the holders allocate with (auto: PyTorch, else CuPy)")
    parser.add_argument("--sizes-mib", type=_sizes, default=list(DEFAULT_SIZES_MIB), metavar="N,N",
                        help="MiB each holder allocates (default 2048,5120)")
    parser.add_argument("--nvidia-smi", default="nvidia-smi", metavar="PATH", help="nvidia-smi to compare against")
    args = parser.parse_args(argv)
    try:
        nvml = open_gpu(args.gpu)
        nvml.close()
        backends = pick_backends(args.backend)
        return check_gpu(argv, args.out, args.gpu, backends, args.sizes_mib, args.nvidia_smi)[0]
    except CannotRun as exc:
        print(f"gpu-check: cannot run here: {exc}; {NEEDS}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
