"""Calibration: its answer without a GPU, and its GPU-side logic behind the NVML boundary with recorded answers.

On this GPU-less machine the model is the real blob detector on the CPU; NVML is the fake library, tf.config
the fake one, and a stand-in reads "TensorFlow's" memory figures, which follow the model calls.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import threading

import pytest

from app.fleet.calibrate import (
    NEEDS_GPU, CalibrationError, calibrate, main, measure, measured_overhead, recommend_cap, run_phase_in_child,
)
from app.fleet.plan import load_fleet
from app.gpu.memory_policy import MemorySpec, parse_memory_spec
from app.settings import load_settings

from conftest import ROOT
from fake_nvml import FakeNvml, NVMLError
from fake_tf_config import FakeTfConfig

PID = 4321
OVERHEAD = 480  # MiB the fake process holds beyond TensorFlow's pool or cap


class GpuMemory:
    """What TensorFlow and NVML report while a model runs: growth pools in doubling regions, a cap maps it all."""

    def __init__(self, library: FakeNvml, spec: MemorySpec):
        self.library, self.spec = library, spec
        self.current = self.peak = 0.0

    def loaded(self):
        self._set(current=20.0)

    def call(self, batch):
        self._set(current=200.0 + 10 * batch.shape[0])  # activations while the call runs
        self._set(current=20.0)

    def _set(self, current):
        self.current, self.peak = current, max(self.peak, current)
        pool = self.spec.cap_mib if self.spec.mode == "cap" else 2 ** math.ceil(math.log2(self.peak))
        self.library.set_processes(0, (PID, int(pool + OVERHEAD)), (999, 1000))

    def tf_memory(self):
        return [{"device": "/device:GPU:0", "current_mib": self.current, "peak_mib": self.peak}]


class MeteredDetector:
    """The real detector, with each call reflected in the fake GPU memory."""

    def __init__(self, detector, memory: GpuMemory):
        self._detector, self._memory = detector, memory
        self.max_batch, self.input_shape, self.image_shape = detector.max_batch, detector.input_shape, detector.image_shape
        self.model = detector.model
        memory.loaded()

    def run(self, batch):
        self._memory.call(batch)
        return self._detector.run(batch)

    def detect(self, images, *args, **kwargs):
        return self._detector.detect(images, *args, **kwargs)


def _phase(detector, library, runs: list):
    def run_phase(spec, model, gpu, batch, width, height, requests, concurrent=1, execution=None):
        memory = GpuMemory(library, spec)
        result = measure(spec, model, gpu, batch, width, height, requests, concurrent=concurrent,
                         nvml_library=library, execution=execution,
                         tf_config=FakeTfConfig(gpus=1), tf_memory=memory.tf_memory,
                         load=lambda path: MeteredDetector(detector, memory), pid=PID, interval_s=0.01)
        runs.append((spec, result))
        return result

    return run_phase


def test_without_a_gpu_calibration_says_it_needs_one_and_exits_2(blob_model_dir, capsys):
    no_driver = FakeNvml(PID, init_error=NVMLError("Driver Not Loaded"))
    status = main(["--model", str(blob_model_dir)], nvml_library=no_driver)
    assert status == 2
    err = capsys.readouterr().err
    assert f"error: {NEEDS_GPU}" in err and "Driver Not Loaded" in err


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this host has an NVIDIA driver")
def test_the_command_on_this_gpu_less_host_exits_2_before_loading_anything(blob_model_dir):
    result = subprocess.run([sys.executable, "-m", "app", "calibrate", "--model", str(blob_model_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and NEEDS_GPU in result.stderr and "NVML" in result.stderr


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this host has an NVIDIA driver")
def test_each_run_happens_in_a_fresh_process_that_reports_back_why_it_cannot_measure(blob_model_dir):
    with pytest.raises(CalibrationError, match=f"^{NEEDS_GPU}: NVML"):
        run_phase_in_child(MemorySpec("growth"), str(blob_model_dir), 0, 1, 8, 8, 1)


def test_the_cap_is_the_peak_plus_headroom_rounded_up():
    assert recommend_cap(240.0) == 288 and recommend_cap(240.1) == 289 and recommend_cap(100.0, 50) == 150


def test_a_growth_run_records_tensorflows_peak_and_the_process_over_time(detector):
    library = FakeNvml(PID)
    memory = GpuMemory(library, MemorySpec("growth"))
    config = FakeTfConfig(gpus=1)
    result = measure(MemorySpec("growth"), "blob", 0, 4, 64, 48, 5, nvml_library=library, tf_config=config,
                     tf_memory=memory.tf_memory, load=lambda path: MeteredDetector(detector, memory), pid=PID,
                     interval_s=0.01)
    assert ("set_memory_growth", "/physical_device:GPU:0", True) in config.calls
    assert (result.error, result.requests, result.batch, result.width, result.height) == (None, 5, 4, 64, 48)
    assert result.tf_peak_mib == 240.0 and result.nvml_peak_mib == 256 + OVERHEAD
    assert result.pid_visible and result.gpu_name == "NVIDIA H200"
    times = [s.t_s for s in result.samples]
    assert len(times) >= 5 + 2 and times == sorted(times)
    assert library.shut_down


class OverlappingGpuMemory(GpuMemory):
    """Each call holds its activations until it ends; every caller's first call waits for the others' first."""

    def __init__(self, library, spec, callers: int):
        super().__init__(library, spec)
        self.in_flight, self.lock = 0.0, threading.Lock()
        self.first_calls = threading.Barrier(callers, timeout=30)
        self.seen = threading.local()

    def call(self, batch):
        with self.lock:
            self.in_flight += 180.0 + 10 * batch.shape[0]
            self._set(current=20.0 + self.in_flight)
        if not getattr(self.seen, "called", False):
            self.seen.called = True
            self.first_calls.wait()
        with self.lock:
            self.in_flight -= 180.0 + 10 * batch.shape[0]
            self._set(current=20.0 + self.in_flight)


def test_concurrent_calls_are_measured_together_as_the_inference_threads_make_them(detector):
    library = FakeNvml(PID)
    memory = OverlappingGpuMemory(library, MemorySpec("growth"), callers=2)
    result = measure(MemorySpec("growth"), "blob", 0, 4, 64, 48, 5, concurrent=2, nvml_library=library,
                     tf_config=FakeTfConfig(gpus=1), tf_memory=memory.tf_memory,
                     load=lambda path: MeteredDetector(detector, memory), pid=PID, interval_s=0.01)
    assert (result.error, result.requests, result.concurrent) == (None, 5, 2)
    assert result.tf_peak_mib == 20.0 + 2 * 220.0  # both calls' activations at once, not one call's 240
    assert memory.first_calls.n_waiting == 0 and not memory.first_calls.broken


def test_a_capped_run_measures_the_overhead_beyond_the_cap(detector):
    library = FakeNvml(PID)
    spec = parse_memory_spec("288MiB")
    memory = GpuMemory(library, spec)
    config = FakeTfConfig(gpus=1)
    result = measure(spec, "blob", 0, 4, 64, 48, 3, nvml_library=library, tf_config=config,
                     tf_memory=memory.tf_memory, load=lambda path: MeteredDetector(detector, memory), pid=PID)
    assert ("set_logical_device_configuration", "/physical_device:GPU:0", [288]) in config.calls
    assert measured_overhead(result, 288) == OVERHEAD


def test_where_nvml_cannot_see_the_pid_the_gpus_change_stands_in(detector):
    library = FakeNvml(PID)
    library.set_processes(0, (999, 1000))
    memory = GpuMemory(library, MemorySpec("growth"))
    result = measure(MemorySpec("growth"), "blob", 0, 2, 32, 32, 2, nvml_library=library,
                     tf_config=FakeTfConfig(gpus=1), tf_memory=memory.tf_memory,
                     load=lambda path: MeteredDetector(detector, memory), pid=123456)  # NVML lists host pids
    assert not result.pid_visible
    assert result.nvml_peak_mib == 256 + OVERHEAD  # the GPU's used memory, less the 1000 MiB at the start


def test_a_tensorflow_that_sees_no_gpu_cannot_calibrate():
    with pytest.raises(CalibrationError, match=f"{NEEDS_GPU}: no GPU is visible to TensorFlow"):
        measure(MemorySpec("growth"), "blob", 0, 1, 8, 8, 1, nvml_library=FakeNvml(PID),
                tf_config=FakeTfConfig(gpus=0), tf_memory=lambda: [], load=lambda path: None)


@pytest.mark.parametrize("concurrent", [1, 2])
def test_an_out_of_memory_load_is_reported_not_raised(detector, concurrent):
    class ResourceExhaustedError(Exception):
        pass

    class Exhausted(MeteredDetector):
        def run(self, batch):
            raise ResourceExhaustedError("OOM when allocating tensor with shape[4,1080,1920,3]")

    library = FakeNvml(PID)
    memory = GpuMemory(library, parse_memory_spec("64MiB"))
    result = measure(parse_memory_spec("64MiB"), "blob", 0, 4, 64, 48, 3, concurrent=concurrent, nvml_library=library,
                     tf_config=FakeTfConfig(gpus=1), tf_memory=memory.tf_memory,
                     load=lambda path: Exhausted(detector, memory), pid=PID)
    assert result.requests == 0 and result.error.startswith("out of memory under 64MiB: OOM when allocating")


def test_calibrate_recommends_the_peak_plus_20_percent_then_checks_it_under_that_cap(detector):
    runs: list = []
    result = calibrate("blob", 0, 4, 64, 48, 4, run_phase=_phase(detector, FakeNvml(PID), runs))
    assert [str(spec) for spec, _ in runs] == ["growth", "288MiB"]
    assert (result.recommendation.cap_mib, result.recommendation.tf_peak_mib) == (288, 240.0)
    assert result.recommendation.overhead_mib == OVERHEAD


def test_the_command_prints_the_answer_plots_it_and_writes_a_settings_file(detector, blob_model_dir, tmp_path,
                                                                          capsys):
    settings_file, plot = tmp_path / "tuned.toml", tmp_path / "memory.png"
    settings_file.write_text('port = 8001\ngpu_memory = "4GiB"\n\n[models.blob]\ngpu_memory = "1GiB"\nmax_queue = 9\n')
    status = main(["--model", str(blob_model_dir), "--max-batch", "4", "--image-size", "64x48", "--requests", "4",
                   "--plot", str(plot), "--write", str(settings_file)],
                  run_phase=_phase(detector, FakeNvml(PID), []), nvml_library=FakeNvml(PID))
    out = capsys.readouterr().out
    assert status == 0, out
    assert "TensorFlow peak: 240.0 MiB" in out and "recommended cap: 288 MiB (peak + 20%)" in out
    assert f"per-process overhead beyond the cap: {OVERHEAD} MiB" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = load_settings(config_path=settings_file, environ={})
    assert written.for_model("blob").gpu_memory == MemorySpec("cap", cap_mib=288)  # the model's own table
    assert written.for_model("blob").max_queue == 9 and written.port == 8001  # the rest of the file stays
    assert written.gpu_memory == MemorySpec("cap", cap_mib=4096)  # other models keep the server-wide cap
    assert written.gpu_overhead_mib == OVERHEAD


def test_writing_into_a_fleet_file_sets_that_models_cap_and_the_overhead(detector, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    fleet_file = tmp_path / "fleet.toml"
    shutil.copy(ROOT / "config" / "fleet.toml", fleet_file)
    status = main(["--model", "models/faces", "--max-batch", "2", "--image-size", "32x32", "--requests", "2",
                   "--plot", str(tmp_path / "p.png"), "--write", str(fleet_file)],
                  run_phase=_phase(detector, FakeNvml(PID), []), nvml_library=FakeNvml(PID))
    assert status == 0, capsys.readouterr()
    config = load_fleet(fleet_file)
    assert config.gpu_overhead_mib == OVERHEAD
    faces, shapes = config.instances
    assert faces.gpu_memory == MemorySpec("cap", cap_mib=recommend_cap(220.0)) and faces.port == 8001
    assert shapes.gpu_memory == MemorySpec("cap", cap_mib=2048)  # another model's cap stays


@pytest.mark.gpu
def test_on_a_real_gpu_calibration_recommends_a_cap_that_holds(blob_model_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "app", "calibrate", "--model", str(blob_model_dir), "--max-batch", "2",
         "--image-size", "640x480", "--requests", "3", "--plot", str(tmp_path / "p.png"),
         "--write", str(tmp_path / "t.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "recommended cap:" in result.stdout and (tmp_path / "p.png").exists()
    assert load_settings(config_path=tmp_path / "t.toml", environ={}).gpu_memory.mode == "cap"


def test_a_worker_groups_cap_is_its_members_peaks_summed_plus_headroom(blob_model_dir, tmp_path, capsys):
    from app.fleet.calibrate import PhaseResult, Sample

    for name in ("alpha", "beta", "other"):
        shutil.copytree(blob_model_dir / "2", tmp_path / "repo" / name / "1")
    settings_file = tmp_path / "group.toml"
    settings_file.write_text(f'model_repository = "{tmp_path / "repo"}"\n[models.alpha]\nworker_group = "pair"\n'
                             '[models.beta]\nworker_group = "pair"\n')
    peaks = {"alpha": 100.0, "beta": 150.0}
    asked = []

    def run_phase(spec, model, gpu, batch, width, height, requests, concurrent, execution):
        asked.append((str(spec), os.path.basename(model)))
        peak = peaks[os.path.basename(model)]
        return PhaseResult(policy=str(spec), batch=batch, width=width, height=height,
                           samples=[Sample(0.1, None, peak, peak)])

    status = main(["--group", "pair", "--config", str(settings_file), "--write", str(settings_file)],
                  run_phase=run_phase, nvml_library=FakeNvml(PID))
    out = capsys.readouterr().out
    assert status == 0, out
    assert asked == [("growth", "alpha"), ("growth", "beta")]  # each member in a run of its own; not `other`
    assert "recommended cap for the group: 300 MiB" in out  # (100 + 150) + 20%
    written = load_settings(config_path=settings_file, environ={})
    assert written.for_model("alpha").gpu_memory == written.for_model("beta").gpu_memory == MemorySpec("cap", cap_mib=300)
    assert main(["--group", "nobody", "--config", str(settings_file)], run_phase=run_phase,
                nvml_library=FakeNvml(PID)) == 2
    assert main(["--group", "pair", "--model", "models/faces"], run_phase=run_phase, nvml_library=FakeNvml(PID)) == 2
