"""/gpu and the NVML boundary: without NVML, with a stand-in behind the same module, and on a real GPU."""

from __future__ import annotations

import os

import pytest

from app.errors import NvmlUnavailable
from app.gpu.memory_policy import parse_memory_spec
from app.gpu.nvml import Nvml
from app.gpu.report import GpuReport
from app.gpu.setup import setup_gpus
from app.metrics import ServiceMetrics

from fake_nvml import FakeNvml, NVMLError
from fake_tf_config import FakeTfConfig

PID = 1234  # a model worker of this server; FakeNvml shows it holding 4596 MiB on GPU 0
SERVER = 1000  # this server's HTTP process, which holds no GPU memory


def _worker(pid=PID, caps=((0, 4096),), spec="4096MiB", tf=((0, 12.0, 40.5),), model="faces", version="1"):
    """A model worker as the registry describes it to /gpu."""
    return {"pid": pid, "model": model, "version": version, "caps_mib": dict(caps),
            "policy": {"mode": "cap", "spec": spec, "gpus": [{"index": i, "cap_mib": c, "total_mib": 143771}
                                                            for i, c in caps], "note": None},
            "tensorflow": [{"device": f"/device:GPU:{k}", "current_mib": cur, "peak_mib": peak}
                           for k, cur, peak in tf]}


def _report(library, workers=(), selected=None, **options):
    return GpuReport(Nvml.open(library), selected=selected, workers=lambda: [dict(w) for w in workers], pid=SERVER,
                     **options)


def test_without_nvml_the_report_says_why_and_still_names_the_workers_and_their_policies():
    report = GpuReport(None, "NVML Shared Library Not Found", workers=lambda: [_worker()], pid=SERVER).to_json()
    assert report["available"] is False
    assert report["reason"] == "NVML Shared Library Not Found"
    (worker,) = report["workers"]
    assert (worker["model"], worker["version"], worker["pid"]) == ("faces", "1", PID)
    assert worker["policy"]["spec"] == "4096MiB" and worker["caps_mib"] == {0: 4096}


def test_the_real_nvml_on_this_host_is_unavailable_with_a_reason():
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this host has an NVIDIA driver")
    with pytest.raises(NvmlUnavailable, match="NVML"):
        Nvml.open()


def test_init_failure_becomes_nvml_unavailable():
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        Nvml.open(FakeNvml(PID, init_error=NVMLError("Driver Not Loaded")))


def test_the_report_shows_what_nvidia_smi_would_with_each_process_named_by_its_model():
    report = _report(FakeNvml(PID), [_worker()], selected=(0,)).to_json()
    assert report["available"] is True
    assert (report["driver_version"], report["cuda_driver_version"]) == ("580.95.05", "13.0")
    (device,) = report["devices"]  # only GPU 0 is this server's
    assert device["name"] == "NVIDIA H200" and device["uuid"].endswith("0000")
    assert device["memory_mib"] == {"total": 143771, "used": 9302, "free": 143771 - 9302 - 555, "reserved": 555}
    assert device["utilization_percent"] == 37
    assert device["processes"] == [
        {"pid": PID, "used_mib": 4596, "this_server": True, "model": "faces/1"},
        {"pid": 4242, "used_mib": 4150, "this_server": False, "model": None},
    ]


def test_memory_info_v1_is_used_where_the_driver_has_no_v2():
    report = _report(FakeNvml(PID, v2=False), [_worker()]).to_json()
    assert report["devices"][0]["memory_mib"]["reserved"] is None
    assert report["devices"][0]["memory_mib"]["used"] == 9302 + 555


def test_unsupported_utilization_and_unattributed_memory_are_null():
    report = _report(FakeNvml(PID), selected=(1,)).to_json()
    (device,) = report["devices"]
    assert device["name"] == "NVIDIA H200"  # bytes from older bindings are decoded
    assert device["utilization_percent"] is None
    assert device["processes"] == [{"pid": 777, "used_mib": None, "this_server": False, "model": None}]


def test_every_gpu_is_reported_when_the_server_may_use_all():
    report = _report(FakeNvml(PID)).to_json()
    assert [d["index"] for d in report["devices"]] == [0, 1]


def test_no_gpu_selected_is_reported_unavailable():
    report = _report(FakeNvml(PID), selected=()).to_json()
    assert report["available"] is False and "DETECT_GPUS=none" in report["reason"]


def test_a_failing_nvml_call_does_not_fail_the_report():
    library = FakeNvml(PID)
    library.nvmlDeviceGetComputeRunningProcesses = lambda handle: (_ for _ in ()).throw(NVMLError("GPU is lost"))
    report = _report(library, [_worker()]).to_json()
    assert report["available"] is False and "GPU is lost" in report["reason"]


def test_gpu_memory_gauges_per_gpu_in_metrics():
    text = ServiceMetrics(_report(FakeNvml(PID))).render().decode()
    assert 'detect_gpu_memory_used_bytes{gpu="0",uuid="GPU-5a1c0d3e-0000-4000-8000-000000000000"} 9.753853952e+09' in text
    assert 'detect_gpu_memory_total_bytes{gpu="1"' in text


def test_no_gpu_gauges_without_nvml():
    assert "detect_gpu_memory" not in ServiceMetrics(GpuReport(None, "none")).render().decode()


def test_a_share_is_sized_from_nvml_at_boot():
    """setup_gpus feeds NVML's totals into the policy: 25% of the fake H200 is 35942 MiB."""
    config = FakeTfConfig(gpus=2)
    setup = setup_gpus(parse_memory_spec("25%"), (1,), nvml_library=FakeNvml(PID), tf_config=config)
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


# Accounting: whose memory each process on the GPU is, and what TensorFlow holds unused in each worker.

def _fleet_state(tmp_path, *instances, overhead=500):
    from app.fleet.state import FleetState, InstanceState, write_state

    path = tmp_path / "fleet.json"
    write_state(path, FleetState(fleet_pid=99, gpu_overhead_mib=overhead, instances=tuple(
        InstanceState(name=name, port=port, model=f"models/{name}", gpu_memory=spec, caps_mib=caps, pid=pid,
                      state="ready")
        for name, port, spec, caps, pid in instances
    )))
    return path


def test_accounting_names_our_workers_by_model_other_instances_workers_by_instance_and_the_rest_other(tmp_path):
    """Another instance's worker is matched through its parent, the instance's pid in the fleet state file."""
    library = FakeNvml(PID)
    library.set_processes(0, (PID, 4596), (4242, 2560), (31337, 700))
    state = _fleet_state(tmp_path, ("faces", 8001, "4096MiB", {0: 4096}, SERVER),
                         ("shapes", 8002, "2048MiB", {0: 2048}, 5000))
    report = _report(library, [_worker()], selected=(0,), fleet_state=state, instance_name="faces",
                     parent_of={4242: 5000, 31337: 1}.get).to_json()
    accounting = report["accounting"]
    assert accounting["fleet"]["gpu_overhead_mib"] == 500 and accounting["fleet"]["instances"] == ["faces", "shapes"]
    (gpu,) = accounting["gpus"]
    assert gpu["index"] == 0
    assert gpu["processes"] == [
        {"pid": PID, "owner": "worker", "model": "faces", "version": "1", "instance": "faces", "this_server": True,
         "used_mib": 4596, "cap_mib": 4096, "overhead_mib": 500},
        {"pid": 4242, "owner": "instance", "model": None, "version": None, "instance": "shapes",
         "this_server": False, "used_mib": 2560, "cap_mib": 2048, "overhead_mib": 512},
        {"pid": 31337, "owner": "other", "model": None, "version": None, "instance": None, "this_server": False,
         "used_mib": 700, "cap_mib": None, "overhead_mib": None},
    ]


def test_a_capped_worker_holds_its_cap_less_what_tensorflow_uses():
    """NVML used - TF current - overhead: with a cap TF maps all of it, so the overhead is used - cap."""
    library = FakeNvml(PID)
    library.set_processes(0, (PID, 4596))
    (me,) = _report(library, [_worker()]).to_json()["accounting"]["workers"]
    assert (me["model"], me["pid"], me["pid_visible"], me["source"], me["note"]) == ("faces", PID, True, "nvml", None)
    assert me["gpus"] == [{
        "index": 0, "used_mib": 4596, "tf_current_mib": 12.0, "tf_peak_mib": 40.5, "cap_mib": 4096,
        "overhead_mib": 500, "overhead_from": "NVML used - cap", "held_unused_mib": 4596 - 12.0 - 500,
    }]


def test_growth_keeps_memory_it_no_longer_uses_and_gpu_overhead_mib_sizes_the_overhead():
    """Under growth there is no cap: the gpu_overhead_mib setting stands for the overhead."""
    library = FakeNvml(PID)
    library.set_processes(0, (PID, 3000), (4242, 900))
    growth = _worker(caps=((0, None),), spec="growth", tf=((0, 220.0, 900.0),))
    report = _report(library, [growth], overhead_mib=480).to_json()["accounting"]
    (row,) = report["workers"][0]["gpus"]
    assert row["overhead_from"] == "gpu_overhead_mib" and row["overhead_mib"] == 480
    assert row["held_unused_mib"] == 3000 - 220.0 - 480
    assert report["gpus"][0]["processes"][0]["overhead_mib"] is None  # no cap: nothing to be beyond


def test_when_nvml_cannot_see_a_workers_pid_it_says_so_and_falls_back_to_tensorflow():
    """A container without --pid=host: NVML lists host pids, none of them the worker's."""
    library = FakeNvml(PID)
    library.set_processes(0, (880123, 4596))
    accounting = _report(library, [_worker()]).to_json()["accounting"]
    (me,) = accounting["workers"]
    assert me["pid_visible"] is False and me["source"] == "tensorflow"
    assert f"pid {PID}" in me["note"] and "--pid=host" in me["note"]
    assert me["gpus"][0]["used_mib"] is None and me["gpus"][0]["held_unused_mib"] == 4096 - 12.0
    assert accounting["gpus"][0]["processes"][0]["owner"] == "other"


def test_without_a_fleet_there_is_no_fleet_part(tmp_path):
    report = _report(FakeNvml(PID), [_worker()], selected=(0,)).to_json()["accounting"]
    assert report["fleet"] is None and "fleet_note" not in report
    owners = [(p["pid"], p["owner"], p["overhead_mib"]) for p in report["gpus"][0]["processes"]]
    assert owners == [(PID, "worker", 500), (4242, "other", None)]


@pytest.mark.parametrize("content", [None, "{not json", '{"version": 1, "instances": [{}]}', '{"version": 7}'])
def test_an_unreadable_fleet_state_file_is_noted_and_does_not_fail_the_report(tmp_path, content):
    path = tmp_path / "fleet.json"
    if content is not None:
        path.write_text(content)
    report = _report(FakeNvml(PID), [_worker()], fleet_state=path).to_json()
    assert report["available"] is True
    assert report["accounting"]["fleet"] is None
    assert "fleet state file cannot be used" in report["accounting"]["fleet_note"]


def test_without_nvml_the_accounting_is_each_workers_tensorflow_figures():
    worker = _worker(tf=((0, 100.0, 300.0),))
    report = GpuReport(None, "no driver", workers=lambda: [worker], pid=SERVER).to_json()
    (me,) = report["accounting"]["workers"]
    assert report["accounting"]["gpus"] == [] and me["pid_visible"] is None
    assert me["source"] == "tensorflow" and "NVML is unavailable (no driver)" in me["note"]
    assert me["gpus"][0]["held_unused_mib"] == 3996.0 and me["gpus"][0]["tf_peak_mib"] == 300.0


def test_tensorflows_logical_gpus_map_to_the_workers_physical_ones():
    """A worker on GPU 1 alone: its TensorFlow's GPU:0 is physical GPU 1."""
    library = FakeNvml(PID)
    library.set_processes(1, (PID, 2548))
    worker = _worker(caps=((1, 2048),), spec="2048MiB", tf=((0, 48.0, 96.0),))
    (me,) = _report(library, [worker], selected=(1,)).to_json()["accounting"]["workers"]
    (row,) = me["gpus"]
    assert (row["index"], row["used_mib"], row["tf_current_mib"], row["overhead_mib"]) == (1, 2548, 48.0, 500)
    assert row["held_unused_mib"] == 2000.0


def test_the_budget_sizes_a_share_from_the_whole_device_even_under_a_planning_total():
    """A pod's gpu_total_mib bounds its budget, but 25% is of the GPU, as the worker's policy sizes it."""
    from app.gpu.budget import cap_mib, inventory

    devices = Nvml.open(FakeNvml(PID)).snapshot()
    (gpu,) = inventory(devices, total_mib=20000, selected=(0,))
    assert (gpu.total_mib, gpu.device_total_mib) == (20000, 143771)
    assert cap_mib(parse_memory_spec("25%"), gpu) == 35942
    assert cap_mib(parse_memory_spec("25%"), inventory([], total_mib=20000)[0]) == 5000  # no NVML: the plan's total
