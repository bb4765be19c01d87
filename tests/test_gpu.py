"""/gpu and the NVML boundary: without NVML, with a stand-in behind the same module, and on a real GPU."""

from __future__ import annotations

import os

import pytest

from app.errors import NvmlUnavailable
from app.gpu_report import GpuReport
from app.gpu_setup import GpuSetup, setup_gpus
from app.memory_policy import AppliedPolicy, GpuCap, parse_memory_spec
from app.metrics import ServiceMetrics
from app.nvml import Nvml
from app.settings import Settings

from fake_nvml import FakeNvml, NVMLError
from fake_tf_config import FakeTfConfig

PID = 1234


def _policy(*caps):
    return AppliedPolicy(mode="cap", spec="4096MiB", gpus=tuple(GpuCap(i, c, 143771) for i, c in caps))


def _report(library, policy, selected=None):
    setup = GpuSetup(policy=policy, nvml=Nvml.open(library), nvml_reason=None, selected=selected)
    return GpuReport(setup, tf_memory=lambda: [{"device": "/device:GPU:0", "current_mib": 12.0, "peak_mib": 40.5}],
                     pid=PID)


def test_without_nvml_the_report_says_why_and_still_shows_the_policy():
    policy = AppliedPolicy(mode="growth", spec="growth", gpus=(), note="no GPU is visible to TensorFlow")
    report = GpuReport(GpuSetup(policy=policy, nvml=None, nvml_reason="NVML Shared Library Not Found")).to_json()
    assert report["available"] is False
    assert report["reason"] == "NVML Shared Library Not Found"
    assert report["policy"]["mode"] == "growth" and report["policy"]["note"].startswith("no GPU")


def test_the_real_nvml_on_this_host_is_unavailable_with_a_reason():
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this host has an NVIDIA driver")
    with pytest.raises(NvmlUnavailable, match="NVML"):
        Nvml.open()


def test_init_failure_becomes_nvml_unavailable():
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        Nvml.open(FakeNvml(PID, init_error=NVMLError("Driver Not Loaded")))


def test_the_report_shows_what_nvidia_smi_would_for_this_processes_gpus():
    report = _report(FakeNvml(PID), _policy((0, 4096))).to_json()
    assert report["available"] is True
    assert (report["driver_version"], report["cuda_driver_version"]) == ("580.95.05", "13.0")
    (device,) = report["devices"]  # only GPU 0 is this process's
    assert device["name"] == "NVIDIA H200" and device["uuid"].endswith("0000")
    assert device["memory_mib"] == {"total": 143771, "used": 9302, "free": 143771 - 9302 - 555, "reserved": 555}
    assert device["utilization_percent"] == 37 and device["cap_mib"] == 4096
    assert device["processes"] == [
        {"pid": PID, "used_mib": 4596, "this_process": True},
        {"pid": 4242, "used_mib": 4150, "this_process": False},
    ]
    assert report["tensorflow"][0]["peak_mib"] == 40.5


def test_memory_info_v1_is_used_where_the_driver_has_no_v2():
    report = _report(FakeNvml(PID, v2=False), _policy((0, 4096))).to_json()
    assert report["devices"][0]["memory_mib"]["reserved"] is None
    assert report["devices"][0]["memory_mib"]["used"] == 9302 + 555


def test_unsupported_utilization_and_unattributed_memory_are_null():
    report = _report(FakeNvml(PID), _policy((1, None))).to_json()
    (device,) = report["devices"]
    assert device["name"] == "NVIDIA H200"  # bytes from older bindings are decoded
    assert device["utilization_percent"] is None
    assert device["processes"] == [{"pid": 777, "used_mib": None, "this_process": False}]


def test_a_cpu_only_tensorflow_beside_nvml_reports_every_gpu():
    report = _report(FakeNvml(PID), AppliedPolicy(mode="cap", spec="4096MiB", gpus=())).to_json()
    assert [d["index"] for d in report["devices"]] == [0, 1]


def test_no_gpu_selected_is_reported_unavailable():
    report = _report(FakeNvml(PID), AppliedPolicy(mode="cap", spec="4096MiB", gpus=()), selected=()).to_json()
    assert report["available"] is False and "DETECT_GPUS=none" in report["reason"]


def test_a_failing_nvml_call_does_not_fail_the_report():
    library = FakeNvml(PID)
    library.nvmlDeviceGetComputeRunningProcesses = lambda handle: (_ for _ in ()).throw(NVMLError("GPU is lost"))
    report = _report(library, _policy((0, 4096))).to_json()
    assert report["available"] is False and "GPU is lost" in report["reason"]


def test_gpu_memory_gauges_per_gpu_in_metrics():
    text = ServiceMetrics(_report(FakeNvml(PID), _policy((0, 4096), (1, 4096)))).render().decode()
    assert 'detect_gpu_memory_used_bytes{gpu="0",uuid="GPU-5a1c0d3e-0000-4000-8000-000000000000"} 9.753853952e+09' in text
    assert 'detect_gpu_memory_total_bytes{gpu="1"' in text


def test_no_gpu_gauges_without_nvml():
    setup = GpuSetup(policy=_policy(), nvml=None, nvml_reason="none")
    assert "detect_gpu_memory" not in ServiceMetrics(GpuReport(setup)).render().decode()


def test_a_share_is_sized_from_nvml_at_boot():
    """setup_gpus feeds NVML's totals into the policy: 25% of the fake H200 is 35942 MiB."""
    config = FakeTfConfig(gpus=2)
    setup = setup_gpus(Settings(gpu_memory=parse_memory_spec("25%"), gpus=(1,)), nvml_library=FakeNvml(PID), tf_config=config)
    assert [(g.index, g.cap_mib) for g in setup.policy.gpus] == [(1, 35942)]
    assert ("set_logical_device_configuration", "/physical_device:GPU:1", [35942]) in config.calls


def test_close_shuts_nvml_down_once():
    library = FakeNvml(PID)
    nvml = Nvml.open(library)
    nvml.close()
    assert library.shut_down
    with pytest.raises(NvmlUnavailable, match="shut down"):
        nvml.device_count()


@pytest.mark.gpu
def test_real_nvml_sees_a_process_holding_gpu_memory():
    """On a GPU host: memory held by this process (through CuPy or torch) shows up in NVML's answers."""
    try:
        nvml = Nvml.open()
    except NvmlUnavailable as exc:
        pytest.skip(f"no NVML here: {exc.message}")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        held = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    else:
        cupy = pytest.importorskip("cupy")
        held = cupy.empty(512 * 2**20, dtype=cupy.uint8)
    (device,) = nvml.snapshot([0])
    mine = [p for p in device.processes if p.pid == os.getpid()]
    assert device.memory_total_mib > 0 and device.memory_used_mib >= 512
    assert mine and (mine[0].used_mib is None or mine[0].used_mib >= 512)
    del held
    nvml.close()


# Accounting: which fleet instance each process on the GPU is, and what TensorFlow holds unused.

def _fleet_state(tmp_path, *instances, overhead=500):
    from app.fleet_state import FleetState, InstanceState, write_state

    path = tmp_path / "fleet.json"
    write_state(path, FleetState(fleet_pid=99, gpu_overhead_mib=overhead, instances=tuple(
        InstanceState(name=name, port=port, model=f"models/{name}", gpu_memory=spec, caps_mib=caps, pid=pid,
                      state="ready")
        for name, port, spec, caps, pid in instances
    )))
    return path


def _fleet_report(library, policy, state_path, name="faces", tf_current=12.0):
    setup = GpuSetup(policy=policy, nvml=Nvml.open(library), nvml_reason=None)
    return GpuReport(setup, tf_memory=lambda: [{"device": "/device:GPU:0", "current_mib": tf_current,
                                                "peak_mib": 40.5}],
                     pid=PID, fleet_state=state_path, instance_name=name)


def test_accounting_names_each_process_by_its_fleet_instance_and_the_rest_other(tmp_path):
    """Processes are matched to instances by pid; their overhead is NVML's used MiB beyond the cap."""
    library = FakeNvml(PID)
    library.set_processes(0, (PID, 4596), (4242, 2560), (31337, 700))
    state = _fleet_state(tmp_path, ("faces", 8001, "4096MiB", {0: 4096}, PID),
                         ("shapes", 8002, "2048MiB", {0: 2048}, 4242))
    accounting = _fleet_report(library, _policy((0, 4096)), state).to_json()["accounting"]
    assert accounting["fleet"]["gpu_overhead_mib"] == 500 and accounting["fleet"]["instances"] == ["faces", "shapes"]
    (gpu,) = accounting["gpus"]
    assert gpu["index"] == 0
    assert gpu["processes"] == [
        {"pid": PID, "instance": "faces", "this_process": True, "used_mib": 4596, "cap_mib": 4096, "overhead_mib": 500},
        {"pid": 4242, "instance": "shapes", "this_process": False, "used_mib": 2560, "cap_mib": 2048,
         "overhead_mib": 512},
        {"pid": 31337, "instance": "other", "this_process": False, "used_mib": 700, "cap_mib": None,
         "overhead_mib": None},
    ]


def test_a_capped_instance_holds_its_cap_less_what_tensorflow_uses(tmp_path):
    """NVML used - TF current - overhead: with a cap TF maps all of it, so the overhead is used - cap."""
    library = FakeNvml(PID)
    library.set_processes(0, (PID, 4596))
    state = _fleet_state(tmp_path, ("faces", 8001, "4096MiB", {0: 4096}, PID))
    me = _fleet_report(library, _policy((0, 4096)), state).to_json()["accounting"]["this_instance"]
    assert (me["name"], me["pid"], me["pid_visible"], me["source"], me["note"]) == ("faces", PID, True, "nvml", None)
    assert me["gpus"] == [{
        "index": 0, "used_mib": 4596, "tf_current_mib": 12.0, "tf_peak_mib": 40.5, "cap_mib": 4096,
        "overhead_mib": 500, "overhead_from": "NVML used - cap", "held_unused_mib": 4596 - 12.0 - 500,
    }]


def test_growth_keeps_memory_it_no_longer_uses_and_the_fleet_overhead_sizes_it(tmp_path):
    """Under growth there is no cap: the fleet's gpu_overhead_mib stands for the overhead."""
    library = FakeNvml(PID)
    library.set_processes(0, (PID, 3000), (4242, 900))
    state = _fleet_state(tmp_path, ("faces", 8001, "growth", {0: None}, PID), overhead=480)
    policy = AppliedPolicy(mode="growth", spec="growth", gpus=(GpuCap(0, None, 143771),))
    report = _fleet_report(library, policy, state, tf_current=220.0).to_json()["accounting"]
    (row,) = report["this_instance"]["gpus"]
    assert row["overhead_from"] == "the fleet's gpu_overhead_mib" and row["overhead_mib"] == 480
    assert row["held_unused_mib"] == 3000 - 220.0 - 480
    assert report["gpus"][0]["processes"][0]["overhead_mib"] is None  # no cap: nothing to be beyond


def test_when_nvml_cannot_see_this_pid_it_says_so_and_falls_back_to_tensorflow(tmp_path):
    """A container without --pid=host: NVML lists host pids, none of them this process's."""
    library = FakeNvml(PID)
    library.set_processes(0, (880123, 4596))
    state = _fleet_state(tmp_path, ("faces", 8001, "4096MiB", {0: 4096}, PID))
    accounting = _fleet_report(library, _policy((0, 4096)), state).to_json()["accounting"]
    me = accounting["this_instance"]
    assert me["pid_visible"] is False and me["source"] == "tensorflow"
    assert f"pid {PID}" in me["note"] and "--pid=host" in me["note"]
    assert me["gpus"][0]["used_mib"] is None and me["gpus"][0]["held_unused_mib"] == 4096 - 12.0
    assert accounting["gpus"][0]["processes"][0]["instance"] == "other"


def test_without_a_fleet_the_instance_accounts_for_itself(tmp_path):
    report = _fleet_report(FakeNvml(PID), _policy((0, 4096)), None, name="").to_json()["accounting"]
    assert report["fleet"] is None and "fleet_note" not in report
    names = [(p["pid"], p["instance"], p["overhead_mib"]) for p in report["gpus"][0]["processes"]]
    assert names == [(PID, "(this instance)", 500), (4242, "other", None)]


@pytest.mark.parametrize("content", [None, "{not json", '{"version": 1, "instances": [{}]}', '{"version": 7}'])
def test_an_unreadable_fleet_state_file_is_noted_and_does_not_fail_the_report(tmp_path, content):
    path = tmp_path / "fleet.json"
    if content is not None:
        path.write_text(content)
    report = _fleet_report(FakeNvml(PID), _policy((0, 4096)), path).to_json()
    assert report["available"] is True
    assert report["accounting"]["fleet"] is None
    assert "fleet state file cannot be used" in report["accounting"]["fleet_note"]


def test_without_nvml_the_accounting_is_tensorflows_own():
    policy = _policy((0, 4096))
    report = GpuReport(GpuSetup(policy=policy, nvml=None, nvml_reason="no driver"),
                       tf_memory=lambda: [{"device": "/device:GPU:0", "current_mib": 100.0, "peak_mib": 300.0}],
                       pid=PID).to_json()
    me = report["accounting"]["this_instance"]
    assert report["accounting"]["gpus"] == [] and me["pid_visible"] is None
    assert me["source"] == "tensorflow" and "NVML is unavailable (no driver)" in me["note"]
    assert me["gpus"][0]["held_unused_mib"] == 3996.0 and me["gpus"][0]["tf_peak_mib"] == 300.0


def test_tensorflows_logical_gpus_map_to_the_selected_physical_ones(tmp_path):
    """With DETECT_GPUS=1, TensorFlow's GPU:0 is physical GPU 1."""
    library = FakeNvml(PID)
    library.set_processes(1, (PID, 2548))
    setup = GpuSetup(policy=_policy((1, 2048)), nvml=Nvml.open(library), nvml_reason=None, selected=(1,))
    report = GpuReport(setup, tf_memory=lambda: [{"device": "/device:GPU:0", "current_mib": 48.0, "peak_mib": 96.0}],
                       pid=PID).to_json()
    (row,) = report["accounting"]["this_instance"]["gpus"]
    assert (row["index"], row["used_mib"], row["tf_current_mib"], row["overhead_mib"]) == (1, 2548, 48.0, 500)
    assert row["held_unused_mib"] == 2000.0
