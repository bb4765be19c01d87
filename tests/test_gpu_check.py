"""scripts/gpu-check: its no-GPU exit, each check's judgement, and a whole run against a stand-in GPU.

The stand-in GPU is tests/fake_nvml.py behind app/gpu/nvml.py, whose GPU 0 lists the processes of
tests/fake_gpu_holder.py (the holder protocol without CUDA). The real run needs an NVIDIA GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.fleet.plan import load_fleet, make_plan
from app.gpu.budget import Gpu
from app.gpu.nvml import Nvml
from app.gpu.report import GpuReport
from tools.gpu_check import checks as gpu_check
from tools.gpu_check.checks import FAIL, PASS, SKIP, WARN, Named

from fake_nvml import FakeNvml

ROOT = Path(__file__).resolve().parent.parent

FAKE_HOLDER = Path(__file__).resolve().parent / "fake_gpu_holder.py"
BYSTANDER = 4242  # another user's process, on the GPU before the check starts
BYSTANDER_MIB = 1000


def _device(*processes, v2=True):
    library = FakeNvml(1, v2=v2)
    library.set_processes(0, *processes)
    return Nvml.open(library).snapshot([0])[0]


# --- without a GPU ----------------------------------------------------------------------------------------

def test_without_a_gpu_it_says_why_in_one_line_and_exits_2_writing_nothing(tmp_path):
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this host has an NVIDIA driver")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    env["PYTHON"] = sys.executable
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--out", str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("gpu-check: cannot run here: NVML cannot be initialized")
    assert "CuPy or PyTorch" in line
    assert not (tmp_path / "out").exists()


def test_it_imports_nothing_that_a_gpu_machine_without_the_project_dependencies_lacks():
    """Only the standard library, pynvml and the project's own stdlib-only modules: no Flask, Twisted, TF or numpy."""
    code = ("import sys; import tools.gpu_check.checks, tools.gpu_check.holder; "
            "print('\\n'.join(m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    modules = set(done.stdout.split())
    imported = {name.split(".")[0] for name in modules}
    assert imported & {"flask", "twisted", "tensorflow", "numpy", "werkzeug", "PIL", "torch", "cupy"} == set()
    assert {"app", "pynvml", "tools"} <= imported
    assert {"tools.gpu_check.checks", "tools.gpu_check.holder"} <= modules


def test_without_cupy_or_torch_it_cannot_run(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(gpu_check.CannotRun, match="neither PyTorch nor CuPy"):
        gpu_check.pick_backends("auto")
    with pytest.raises(gpu_check.CannotRun, match="cupy is not installed"):
        gpu_check.pick_backends("cupy")


def test_a_holder_without_its_backend_reports_failed_on_its_channel_and_exits_3():
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    holder = ROOT / "tools" / "gpu_check" / "holder.py"
    done = subprocess.run([sys.executable, str(holder), "--backend", "cupy", "--mib", "1"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 3
    message = json.loads(done.stdout)
    assert message["event"] == "failed" and "cupy" in message["error"]


# --- each check on NVML snapshots -------------------------------------------------------------------------

@pytest.mark.parametrize("used, outcome", [(2048 + 480, PASS), (2048 + 480 + 64, PASS), (2047, FAIL),
                                           (2048 + 480 + 65, FAIL), (None, SKIP)])
def test_a_holder_uses_its_allocation_plus_at_most_a_context(used, outcome):
    check = gpu_check.check_holder_used("h1", _device((50, used)), 50, 2048, context_mib=480)
    assert check.outcome == outcome


def test_a_holder_nvml_does_not_list_fails():
    assert gpu_check.check_holder_used("h1", _device((51, 2500)), 50, 2048, 480).outcome == FAIL


def test_without_a_context_figure_the_default_overhead_bounds_a_holder():
    overhead = gpu_check.DEFAULT_OVERHEAD_MIB
    check = gpu_check.check_holder_used("h1", _device((50, 2048 + overhead)), 50, 2048, context_mib=None)
    assert check.outcome == PASS and check.figures["context_mib"] == overhead


def test_holders_on_another_gpu_than_nvml_numbers_fail():
    device = _device()
    own = device.uuid.removeprefix("GPU-")
    assert gpu_check.check_holder_gpu(device, {"context": own, "h1": own}).outcome == PASS
    other = gpu_check.check_holder_gpu(device, {"context": own, "h1": own[:-1] + "1"})
    assert other.outcome == FAIL and "h1 on" in other.detail and "CUDA_VISIBLE_DEVICES" in other.detail
    assert gpu_check.check_holder_gpu(device, {"context": None}).outcome == SKIP


def test_pids_nvml_hides_are_named_with_what_it_lists_instead():
    assert gpu_check.pid_visibility(_device((50, 1), (51, 1)), [50, 51])[0] is True
    visible, note = gpu_check.pid_visibility(_device(), [50])
    assert visible is False and "no compute process" in note
    visible, note = gpu_check.pid_visibility(_device((1000050, 1)), [50])
    assert visible is False and "1000050" in note and "--pid=host" in note


def test_nvidia_smi_output_is_parsed_per_gpu():
    rows = gpu_check.parse_nvidia_smi("0, 143771, 9302, 133914, 580.95.05\n1, 143771, 0, 143216, 580.95.05\n")
    assert rows[1] == {"total_mib": 143771, "used_mib": 0, "free_mib": 143216, "driver_version": "580.95.05"}
    with pytest.raises(ValueError, match="expected 5 fields"):
        gpu_check.parse_nvidia_smi("Field \"memory.used\" is not a valid field to query.")


@pytest.mark.parametrize("v2", [True, False])
def test_device_totals_match_nvidia_smi_whether_or_not_it_counts_the_reserved_memory(v2):
    device = _device((50, 9302), v2=v2)
    smi_used = 9302 if v2 else 9302 + 555
    smi = {"total_mib": 143771, "used_mib": smi_used, "free_mib": 143771 - 9302 - 555, "driver_version": "580.95.05"}
    assert gpu_check.check_device_totals(device, "580.95.05", smi).outcome == PASS
    assert gpu_check.check_device_totals(device, "580.95.05", dict(smi, total_mib=143770)).outcome == FAIL
    assert gpu_check.check_device_totals(device, "580.95.05", dict(smi, used_mib=smi_used + 100)).outcome == FAIL
    assert gpu_check.check_device_totals(device, "575.57.08", smi).outcome == FAIL
    assert gpu_check.check_device_totals(device, "580.95.05", None, "nvidia-smi is not on the PATH").outcome == SKIP


def test_the_bare_context_must_fit_the_default_overhead_and_the_libraries_only_warn():
    assert gpu_check.check_context_overhead(480, "NVML per-process used").outcome == PASS
    failed = gpu_check.check_context_overhead(1025, "NVML per-process used")
    assert failed.outcome == FAIL and "1024 MiB" in failed.detail
    # On an H200 (CUDA 13): 520 MiB bare and 720 with cuBLAS and cuDNN, inside the default of 1024.
    assert gpu_check.check_context_overhead(520, "NVML per-process used").outcome == PASS
    assert gpu_check.check_libraries_overhead(720, ["cublas"], "x").outcome == PASS
    warned = gpu_check.check_libraries_overhead(1100, ["cublas", "cudnn"], "x")
    assert warned.outcome == WARN and "cublas + cudnn" in warned.name and "calibrate" in warned.detail


@pytest.mark.parametrize("samples, outcome", [
    ([(0.0, 1000), (0.4, 3000)], PASS),
    ([(0.0, 1000), (6.0, 3000)], FAIL),  # back, but late
    ([(0.0, 1000), (20.0, 1000)], FAIL),  # never back
])
def test_memory_must_be_back_in_the_free_figure_within_the_limit(samples, outcome):
    check = gpu_check.check_release("h1", 2048, 1000, samples, limit_s=5.0)
    assert check.outcome == outcome
    assert check.figures["target_free_mib"] == 1000 + 2048 - gpu_check.SLACK_MIB


# --- the accounting and the budget, through the project's own modules -----------------------------------

def _accounting(tmp_path, library, named, me, bystander):
    """The /gpu report of a server whose model workers are the named holders."""
    workers = [{"pid": n.pid, "model": n.name, "version": "1", "caps_mib": {0: n.cap_mib},
                "policy": {"mode": "cap", "spec": f"{n.cap_mib}MiB", "note": None,
                           "gpus": [{"index": 0, "cap_mib": n.cap_mib, "total_mib": 143771}]},
                "tensorflow": [{"device": "/device:GPU:0", "current_mib": 1024.0, "peak_mib": 1024.0}]}
               for n in named]
    return GpuReport(Nvml.open(library), selected=(0,), workers=lambda: workers, pid=1).to_json()


def test_the_accounting_names_each_holder_with_its_overhead_and_the_context_as_other(tmp_path):
    library = FakeNvml(1)
    library.set_processes(0, (60, 480), (61, 2048 + 490), (62, 5120 + 470))
    named = [Named("h1", 61, 2048), Named("h2", 62, 5120)]
    report = _accounting(tmp_path, library, named, named[0], 60)
    checks = gpu_check.check_accounting(report, 0, named, named[0], 1024.0, 60, visible=True)
    assert [c.outcome for c in checks] == [PASS] * 4
    report["accounting"]["gpus"][0]["processes"][1]["overhead_mib"] = 470  # as if /gpu had got it wrong
    assert gpu_check.check_accounting(report, 0, named, named[0], 1024.0, 60, visible=True)[0].outcome == FAIL


def test_where_nvml_hides_the_pids_the_accounting_must_fall_back_to_tensorflow(tmp_path):
    library = FakeNvml(1)
    library.set_processes(0, (1000060, 480), (1000061, 2048 + 490))
    named = [Named("h1", 61, 2048)]
    report = _accounting(tmp_path, library, named, named[0], 60)
    (check,) = gpu_check.check_accounting(report, 0, named, named[0], 1024.0, 60, visible=False)
    assert check.outcome == PASS and "falls back" in check.name


def _plan_file(tmp_path, caps):
    path = tmp_path / "fleet.toml"
    path.write_text(gpu_check.fleet_toml([(f"i{n}", cap) for n, cap in enumerate(caps)], 0))
    return load_fleet(path)


@pytest.mark.parametrize("reserved", [0, 555])
def test_the_budget_is_checked_against_the_available_memory(tmp_path, reserved):
    total, overhead = 143771, gpu_check.DEFAULT_OVERHEAD_MIB
    fill = total - 2048 - 5120 - 3 * overhead
    for caps in ([2048, 5120], [2048, 5120, fill], [2048, 5120, fill + 1]):
        plan = make_plan(_plan_file(tmp_path, caps), [Gpu(0, total, reserved_mib=reserved)])
        check = gpu_check.check_plan("plan", plan, 0, caps, overhead, total - reserved)
        assert check.outcome == PASS, check.detail
        assert check.figures["fits"] == (sum(caps) + overhead * len(caps) <= total - reserved)
    wrong = make_plan(_plan_file(tmp_path, [2048]), [Gpu(0, total)])
    assert gpu_check.check_plan("plan", wrong, 0, [2048], 400, total).outcome == FAIL  # 400 is not the overhead


def test_the_dry_run_must_exit_0_when_it_fits_and_2_when_not():
    assert gpu_check.check_dry_run("d", 0, "GPU 0: needs 9000 MiB (caps", "", 9000, True).outcome == PASS
    assert gpu_check.check_dry_run("d", 2, "GPU 0: needs 9000 MiB", "error: GPU 0 is over budget", 9000,
                                   False).outcome == PASS
    assert gpu_check.check_dry_run("d", 0, "GPU 0: needs 9000 MiB", "", 9000, False).outcome == FAIL
    assert gpu_check.check_dry_run("d", 0, "GPU 0: needs 8999 MiB", "", 9000, True).outcome == FAIL


# --- a whole run against the stand-in GPU -----------------------------------------------------------------

class HolderGpu(FakeNvml):
    """FakeNvml whose GPU 0 lists a bystander and every fake holder in `folder` (as host pids if `hide_pids`)."""

    def __init__(self, folder: Path, hide_pids: bool = False):
        super().__init__(1)
        self.folder, self.hide_pids = folder, hide_pids

    def _refresh(self):
        held = [(int(p.name), int(p.read_text())) for p in self.folder.iterdir() if p.name.isdigit()]
        offset = 1_000_000 if self.hide_pids else 0
        self.set_processes(0, (BYSTANDER, BYSTANDER_MIB), *[(pid + offset, mib) for pid, mib in held])

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        self._refresh()
        return super().nvmlDeviceGetMemoryInfo(handle, version)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self._refresh()
        return super().nvmlDeviceGetComputeRunningProcesses(handle)


def _nvidia_smi(tmp_path, folder):
    """An nvidia-smi that prints GPU 0 as HolderGpu shows it."""
    path = tmp_path / "nvidia-smi"
    path.write_text(f"""#!{sys.executable}
from pathlib import Path
used = {BYSTANDER_MIB} + sum(int(p.read_text()) for p in Path({str(folder)!r}).iterdir() if p.name.isdigit())
print(f"0, 143771, {{used}}, {{143771 - 555 - used}}, 580.95.05")
""")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def stand_in_gpu(tmp_path, monkeypatch):
    folder = tmp_path / "gpu"
    folder.mkdir()
    monkeypatch.setenv("FAKE_GPU_DIR", str(folder))
    monkeypatch.setenv("FAKE_CONTEXT_MIB", "480")
    monkeypatch.setenv("FAKE_LIBS_MIB", "15")
    monkeypatch.setattr(gpu_check, "RELEASE_LIMIT_S", 1.0)
    monkeypatch.setattr(gpu_check, "RELEASE_WAIT_S", 0.0)
    return folder


# What tools/gpu_check/precision.py's TensorFlow child says on an H200 (no TensorFlow on the stand-in GPU).
H200_PRECISION = {"gpus": ["NVIDIA H200"], "compute_capability": [9, 0], "tensorflow": "2.21.0",
                  "execution": {"precision": "fp16", "asked": "auto", "gate": "passed", "hardware": "NVIDIA H200",
                                "reason": "auto: fp16 on tensor cores", "parity": {
                                    "photos": 4, "detections": 9, "matched": 9, "max_score_difference": 0.004,
                                    "min_iou": 0.99, "problems": []}},
                  "ms_per_image": {"fp32": 2.1, "fp16": 1.2}}


# What tools/gpu_check/groups.py's server shows where a worker group works: shapes and faces in one worker, objects
# in its own, and NVML listing each worker once (a made-up run: no TensorFlow has run on a lent GPU).
GROUP_ON_GPU = {"pids": {"shapes": 4101, "faces": 4101, "objects": 4102}, "gpu_pids": [4101, 4102]}


def _run(tmp_path, library, folder, backends=("cupy",), tensorflow_child=lambda gpu: H200_PRECISION):
    out = tmp_path / "out"
    status, report = gpu_check.check_gpu(["--out", str(out)], out, 0, list(backends), [2048, 5120],
                                         nvidia_smi=_nvidia_smi(tmp_path, folder), nvml_library=library,
                                         holder_script=FAKE_HOLDER, tensorflow_child=tensorflow_child,
                                         group_server=lambda gpu: GROUP_ON_GPU)
    assert json.loads((out / "gpu-check.json").read_text()) == json.loads(json.dumps(report))
    assert (out / "gpu-check.txt").read_text().startswith("gpu-check: NVIDIA H200")
    return status, report, {c["name"]: c for c in report["checks"]}


def test_a_whole_run_checks_every_claim_and_ends_every_holder(tmp_path, stand_in_gpu, capsys):
    """A first backend that cannot use the GPU is passed over for the next."""
    status, report, checks = _run(tmp_path, HolderGpu(stand_in_gpu), stand_in_gpu, backends=("broken", "cupy"))
    assert {c["outcome"] for c in checks.values()} == {PASS}, [c for c in checks.values() if c["outcome"] != PASS]
    assert status == 0 and report["result"] == PASS
    assert report["backend"] == {"name": "cupy", "version": "0-fake"} and report["pids_visible"] is True
    assert report["measured"]["context_overhead_mib"] == 480
    assert report["measured"]["context_overhead_from"] == "NVML per-process used"
    assert report["measured"]["libs_overhead_mib"] == 480 + 15
    assert [h["pid_used_mib"] for h in report["measured"]["holders"]] == [2048 + 480, 5120 + 480]
    assert set(report["measured"]["release"]) == {"context", "h1-2048MiB", "h2-5120MiB"}
    assert not list(stand_in_gpu.iterdir())  # every holder gone, and its memory with it
    assert checks["nvml: device totals = nvidia-smi"]["figures"]["used_matches"] == "used"
    assert len([name for name in checks if name.startswith("fleet: ")]) == 6
    assert "over budget" in checks["fleet: --dry-run --gpu-total-mib 143771, over"]["figures"]["stderr"]
    assert checks["fleet: plan on NVML's inventory, full"]["figures"]["fits"] is False  # 555 MiB reserved
    printed = capsys.readouterr().out
    assert printed.startswith("gpu-check: NVIDIA H200 (GPU 0, 143771 MiB), driver 580.95.05")
    assert f"{len(checks)} checks: {len(checks)} pass, 0 fail, 0 warn, 0 skip: pass" in printed


def test_where_nvml_hides_the_holders_pids_it_says_so_and_checks_the_fallback(tmp_path, stand_in_gpu):
    status, report, checks = _run(tmp_path, HolderGpu(stand_in_gpu, hide_pids=True), stand_in_gpu)
    assert status == 0 and report["pids_visible"] is False
    assert checks["nvml: holders' pids listed"]["outcome"] == WARN
    assert "--pid=host" in checks["nvml: holders' pids listed"]["detail"]
    assert checks["accounting: falls back to TensorFlow's figures where NVML hides the pids"]["outcome"] == PASS
    assert checks["nvml: h2-5120MiB device used rose by allocation + context"]["outcome"] == PASS
    assert report["measured"]["context_overhead_from"] == "rise of the device's used memory"
    assert report["measured"]["context_overhead_mib"] == 480


def test_a_claim_that_does_not_hold_fails_the_run(tmp_path, stand_in_gpu, monkeypatch):
    """A context over the default overhead, and memory that never comes back, each fail; the run exits 1."""
    monkeypatch.setenv("FAKE_CONTEXT_MIB", str(gpu_check.DEFAULT_OVERHEAD_MIB + 120))
    monkeypatch.setenv("FAKE_LEAK_MIB", "5120")
    status, report, checks = _run(tmp_path, HolderGpu(stand_in_gpu), stand_in_gpu)
    failed = sorted(name for name, c in checks.items() if c["outcome"] == FAIL)
    assert failed == ["overhead: bare CUDA context <= default gpu_overhead_mib", "release: device back to its baseline",
                      "release: h2-5120MiB"]
    assert checks["overhead: context + cublas + cudnn <= default gpu_overhead_mib"]["outcome"] == WARN
    assert "not back after" in checks["release: h2-5120MiB"]["detail"]
    assert status == 1 and report["result"] == FAIL


def test_no_holder_that_can_use_the_gpu_means_it_cannot_run(tmp_path, stand_in_gpu):
    with pytest.raises(gpu_check.CannotRun, match="cannot use the GPU: RuntimeError: no CUDA device"):
        gpu_check.check_gpu([], tmp_path / "out", 0, ["broken"], [2048], nvml_library=HolderGpu(stand_in_gpu),
                            holder_script=FAKE_HOLDER)


def test_the_precision_claims_are_judged_from_the_tensorflow_childs_figures():
    from tools.gpu_check.precision import judge, precision_checks

    assert [c.outcome for c in judge(H200_PRECISION)] == [PASS, PASS, PASS]
    fp32_on_tensor_cores = {**H200_PRECISION, "execution": {**H200_PRECISION["execution"], "precision": "fp32",
                                                            "gate": "failed"}}
    assert [c.outcome for c in judge(fp32_on_tensor_cores)] == ["fail", "fail", PASS]
    slower = {**H200_PRECISION, "ms_per_image": {"fp32": 1.0, "fp16": 1.5}}
    assert [c.outcome for c in judge(slower)][-1] == "warn"
    kept_out_by_speed = {**H200_PRECISION, "execution": {**H200_PRECISION["execution"], "precision": "fp32",
                                                         "speedup": 0.97}}
    assert [c.outcome for c in judge(kept_out_by_speed)][0] == "warn"
    pascal = {**H200_PRECISION, "compute_capability": [6, 0],
              "execution": {**H200_PRECISION["execution"], "precision": "fp32"}}
    assert [c.outcome for c in judge(pascal)] == [PASS]  # no tensor cores: fp32, nothing more to check
    assert judge({"gpus": []})[0].outcome == "skip" and judge({"error": "exit status 1"})[0].outcome == "fail"
    assert precision_checks(0, lambda gpu: {"gpus": []})[0].detail.startswith("TensorFlow sees no GPU")


def test_the_worker_group_claim_is_judged_from_what_the_server_and_nvml_showed(tmp_path, monkeypatch):
    from app.settings import load_settings
    from tools.gpu_check import groups

    assert groups.judge(GROUP_ON_GPU).outcome == PASS
    apart = {**GROUP_ON_GPU, "pids": {"shapes": 4101, "faces": 4103, "objects": 4102}}
    assert "name 2 worker pid(s), not one" in groups.judge(apart).detail
    twice = {**GROUP_ON_GPU, "gpu_pids": [4101, 4101, 4102]}  # two contexts in the group's one process
    assert "4101 2 time(s) on the GPU, not once" in groups.judge(twice).detail
    unseen = {**GROUP_ON_GPU, "gpu_pids": [4102]}
    assert groups.judge(unseen).outcome == "fail"
    not_loaded = {**GROUP_ON_GPU, "pids": {"shapes": None, "faces": None, "objects": 4102}}
    assert groups.judge(not_loaded).outcome == "fail"
    assert groups.judge({"error": "TimeoutError: not ready"}).outcome == "fail"
    # Without TensorFlow, a skip that says so; the server's settings are ones the server takes.
    monkeypatch.setattr(groups.importlib.util, "find_spec", lambda name: None)
    assert groups.group_checks(0)[0].outcome == "skip"
    config = tmp_path / "server.toml"
    config.write_text(groups.settings_text(0))
    settings = load_settings(config_path=config, environ={})
    assert [settings.for_model(m).worker_group for m in ("shapes", "faces", "objects")] == ["pair", "pair", ""]
    assert str(settings.for_model("shapes").gpu_memory) == str(settings.for_model("objects").gpu_memory)
