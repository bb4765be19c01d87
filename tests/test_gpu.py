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
