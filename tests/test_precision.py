"""Execution accelerators: the precision a model computes at, chosen for the hardware, behind the parity gate.

The choice is logic over the hardware (CPU flags, GPUs as tf.config describes them); the GPU side runs
on the GPU stand-in (tests/fake_tf_config.py), which records the Grappler options that reach it. bf16
runs for real on this CPU: the gate on the shipped models' reference photos, and a served model that
says what it computes at in /models, the metrics and Triton's model configuration.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from app.errors import ConfigError
from app.fleet.calibrate import measure
from app.gpu.memory_policy import MemorySpec
from app.inference.accelerators import (Gpu, Hardware, apply_precision, choose_precision, optimizer_options,
                                        read_cpu, read_hardware)
from app.inference.detections import Box, Detection
from app.inference.detector import load_detector
from app.inference.parity import (GATE_THRESHOLD, SCORE_TOLERANCE, add_reference_photos, compare, decoded_reference,
                                  reference_photos, settle_detector, settle_execution)
from app.settings import load_settings

from conftest import ROOT, start_server
from fake_nvml import FakeNvml
from fake_tf_config import FakeTfConfig

MODELS = ROOT / "models"
MAX_PIXELS = 40_000_000
NATIVE = Hardware((), frozenset({"avx512f", "avx512_bf16"}), "AMD EPYC")
EMULATED = Hardware((), frozenset({"avx512f"}), "Intel Xeon")
AVX2 = Hardware((), frozenset({"avx2", "fma"}), "AMD EPYC 7763")
# Whether TensorFlow's oneDNN rewrites to bf16 on this machine's CPU (natively or emulated); without, bf16 is fp32.
THIS_CPU = Hardware((), *read_cpu())
H100 = Hardware((Gpu("NVIDIA H100", (9, 0)),), frozenset(), "")
P100 = Hardware((Gpu("Tesla P100", (6, 0)),), frozenset(), "")


@pytest.fixture
def fp32_after():
    """TensorFlow's precision options are the process's: put this test process back at fp32 afterwards."""
    yield
    apply_precision("fp32")


# -- the choice --------------------------------------------------------------------------------------


@pytest.mark.parametrize("asked, hardware, expected, said", [
    ("auto", NATIVE, "bf16", "avx512_bf16"),
    ("auto", EMULATED, "fp32", "emulated"),
    ("auto", H100, "fp16", "tensor cores"),
    ("auto", P100, "fp32", "no tensor cores"),
    ("fp32", NATIVE, "fp32", "fp32 asked"),
    ("bf16", EMULATED, "bf16", "slower than fp32"),  # asked for: run, and say it will be slow
    ("bf16", AVX2, "fp32", "no bf16 kernels"),  # TensorFlow would not rewrite the graph: say fp32, not bf16
    ("auto", AVX2, "fp32", "emulated"),
    ("bf16", H100, "fp32", "ask for fp16"),  # oneDNN's bf16 rewrites CPU kernels only
    ("fp16", NATIVE, "fp32", "needs a GPU"),
    ("fp16", P100, "fp16", "fp16 asked"),
])
def test_auto_picks_only_what_the_hardware_runs_fast_and_a_choice_says_why(asked, hardware, expected, said):
    precision, why = choose_precision(asked, hardware)
    assert precision == expected and said in why


def test_the_cpu_flags_come_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx512f avx512_bf16\n\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx512f avx512_bf16\n")
    flags, name = read_cpu(cpuinfo)
    assert "avx512_bf16" in flags and name == "AMD EPYC 9R14"
    assert read_cpu(tmp_path / "missing") == (frozenset(), "")


def test_on_a_gpu_configuration_fp16_reaches_tensorflow_as_automatic_mixed_precision():
    """The GPU path as logic: the visible GPUs as tf.config describes them, and the option that reaches it."""
    config = FakeTfConfig(gpus=2, compute_capability=(8, 0), gpu_name="NVIDIA A100")
    config.set_visible_devices(config.devices[:1], "GPU")  # the memory policy chose GPU 0
    hardware = read_hardware(config, cpuinfo=Path("/nonexistent"))
    assert hardware.gpus == (Gpu("NVIDIA A100", (8, 0)),)
    assert choose_precision("auto", hardware)[0] == "fp16"
    apply_precision("fp16", config)
    assert config.options == {"auto_mixed_precision": True, "auto_mixed_precision_onednn_bfloat16": False}
    apply_precision("fp32", config)
    assert not any(config.options.values())
    assert optimizer_options("bf16") == {"auto_mixed_precision": False, "auto_mixed_precision_onednn_bfloat16": True}


# -- the comparison ----------------------------------------------------------------------------------


CLASS_IDS = {"person": 1, "car": 3, "cat": 17, "dog": 18, "chair": 62}


def det(label, score, box=(10, 10, 110, 110)):
    return Detection(label, CLASS_IDS[label], score, Box(*box))


@pytest.mark.parametrize("theirs, passes, problem", [
    ([det("person", 0.80), det("chair", 0.40)], True, None),
    ([det("person", 0.79), det("chair", 0.41)], True, None),  # scores within the tolerance
    ([det("person", 0.80 - 2 * SCORE_TOLERANCE), det("chair", 0.40)], False, "became"),
    ([det("person", 0.80, (10, 10, 110, 125)), det("chair", 0.40)], False, "became"),  # IoU 0.87
    ([det("dog", 0.80), det("chair", 0.40)], False, "person"),  # another class in its place
    ([det("person", 0.80), det("chair", 0.40), det("car", 0.60, (200, 200, 250, 250))], False, "appeared"),
    ([det("person", 0.80)], False, "chair"),  # a detection gone
])
def test_the_gate_wants_the_same_classes_boxes_within_iou_and_scores_within_tolerance(theirs, passes, problem):
    ours = [det("person", 0.80), det("chair", 0.40)]
    result = compare(["photo.jpg"], [ours], [theirs], threshold=0.3)
    assert result.passed is passes
    if problem:
        assert problem in " ".join(result.problems) and "photo.jpg" in result.problems[0]


def test_a_detection_may_cross_the_threshold_only_by_a_score_change_within_the_tolerance():
    """Both runs list what scores down to the tolerance below the threshold, as the gate runs them."""
    above, below = 0.3 + SCORE_TOLERANCE / 3, 0.3 - SCORE_TOLERANCE / 3
    assert compare(["p"], [[det("person", 0.8), det("cat", above)]], [[det("person", 0.8), det("cat", below)]],
                   threshold=0.3).passed
    assert compare(["p"], [[det("person", 0.8), det("cat", below)]], [[det("person", 0.8), det("cat", above)]],
                   threshold=0.3).passed
    gone = compare(["p"], [[det("person", 0.8), det("cat", above)]], [[det("person", 0.8)]], threshold=0.3)
    assert not gone.passed and "cat" in gone.problems[0]  # just over the line, and then nothing: a change
    new = compare(["p"], [[det("person", 0.8)]], [[det("person", 0.8), det("cat", above)]], threshold=0.3)
    assert not new.passed and "appeared" in new.problems[0]


def test_photos_with_nothing_above_the_threshold_check_nothing_and_fail_the_gate():
    result = compare(["p"], [[det("cat", 0.1)]], [[det("cat", 0.1)]], threshold=0.3)
    assert not result.passed and "nothing was compared" in result.problems[0]


# -- the gate --------------------------------------------------------------------------------------


def run_gate(outputs: dict, asked="bf16", gate=True, photos=(("a.jpg", "image"),), hardware=NATIVE, seconds=None):
    """The gate over a model whose detections at each precision are `outputs[precision]` (or an exception),
    and whose model call takes `seconds[precision]`."""
    config = FakeTfConfig(gpus=0)
    ran = []

    def in_force():
        return next((p for p, on in (("bf16", config.options.get("auto_mixed_precision_onednn_bfloat16")),
                                     ("fp16", config.options.get("auto_mixed_precision"))) if on), "fp32")

    def detect(images, floor):
        ran.append(in_force())
        if isinstance(outputs[in_force()], Exception):
            raise outputs[in_force()]
        return [[d for d in outputs[in_force()] if d.score >= floor]]

    timed = None if seconds is None else (lambda images: lambda: seconds[in_force()])
    execution = settle_execution(detect, lambda: list(photos), asked, gate, GATE_THRESHOLD, hardware, config, timed)
    return execution, ran, config


def test_a_precision_that_keeps_the_answers_is_kept():
    same = [det("person", 0.8)]
    execution, ran, config = run_gate({"fp32": same, "bf16": [det("person", 0.795)]})
    assert (execution.precision, execution.gate) == ("bf16", "passed") and ran == ["fp32", "bf16"]
    assert config.options["auto_mixed_precision_onednn_bfloat16"] is True  # left on for the calls to come
    assert execution.parity["matched"] == 1 and execution.parity["max_score_difference"] == pytest.approx(0.005)


@pytest.mark.parametrize("candidate, said", [
    ([det("person", 0.5)], "changed the answers"),
    (ValueError("ConcatOp : Dimension 1 in both shapes must be equal"), "failed to run"),
])
def test_a_precision_that_changes_or_breaks_the_answers_serves_fp32_and_says_why(candidate, said):
    execution, _, config = run_gate({"fp32": [det("person", 0.8)], "bf16": candidate})
    assert (execution.precision, execution.gate) == ("fp32", "failed") and said in execution.reason
    assert not any(config.options.values())


@pytest.mark.parametrize("bf16_s, kept", [(0.020, "bf16"), (0.029, "fp32"), (0.045, "fp32")])
def test_auto_keeps_a_precision_that_passes_only_where_it_is_faster(bf16_s, kept):
    same = [det("person", 0.8)]
    execution, _, config = run_gate({"fp32": same, "bf16": same}, asked="auto", seconds={"fp32": 0.030, "bf16": bf16_s})
    assert execution.precision == kept and execution.gate == "passed"
    assert execution.speedup == pytest.approx(0.030 / bf16_s, abs=1e-3)
    assert config.options["auto_mixed_precision_onednn_bfloat16"] is (kept == "bf16")
    if kept == "fp32":
        assert f"{execution.speedup:.2f}x fp32's speed (auto wants 1.05x), so it serves fp32" in execution.reason
    # asked for by name, it is not timed: the user chose it
    assert run_gate({"fp32": same, "bf16": same}, seconds={"fp32": 0.03, "bf16": 0.045})[0].precision == "bf16"


def test_reference_photos_that_fail_even_in_fp32_leave_the_model_in_fp32_and_loaded():
    execution, ran, _ = run_gate({"fp32": MemoryError("OOM when allocating tensor"), "bf16": []})
    assert (execution.precision, execution.gate) == ("fp32", "failed") and ran == ["fp32"]
    assert "failed to run in fp32 (MemoryError: OOM when allocating tensor)" in execution.reason
    assert not execution.reusable  # an error decided it: the next load checks again


def test_reference_photos_that_cannot_be_read_leave_the_model_in_fp32_and_loaded(tmp_path):
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    add_reference_photos(version, {"broken.jpg": b"not a JPEG at all"})

    def unreadable():
        return decoded_reference(version, MAX_PIXELS)

    config = FakeTfConfig(gpus=0)
    execution = settle_execution(lambda images, floor: [], unreadable, "bf16", True, 0.3, NATIVE, config)
    assert (execution.precision, execution.gate) == ("fp32", "failed") and "could not be read" in execution.reason
    assert not any(config.options.values()) and not execution.reusable


def test_without_reference_photos_a_reduced_precision_is_not_used():
    execution, ran, _ = run_gate({"fp32": [], "bf16": []}, photos=())
    assert execution.precision == "fp32" and "no reference photos" in execution.reason and ran == []


def test_a_forced_precision_skips_the_gate_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        execution, ran, config = run_gate({"fp32": [], "bf16": ValueError("never run")}, gate=False)
    assert (execution.precision, execution.gate) == ("bf16", "skipped") and ran == []
    assert config.options["auto_mixed_precision_onednn_bfloat16"] and "without the parity gate" in caplog.text


def test_fp32_needs_no_gate_and_turns_every_rewrite_off():
    execution, ran, config = run_gate({"fp32": []}, hardware=EMULATED, asked="auto")
    assert (execution.precision, execution.gate, ran) == ("fp32", "none", [])
    assert config.options == {"auto_mixed_precision": False, "auto_mixed_precision_onednn_bfloat16": False}


# -- reference photos --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["objects", "faces", "shapes"])
def test_each_shipped_model_names_reference_photos_it_finds_things_in(name):
    photos = reference_photos(MODELS / name / "1")
    assert len(photos) >= 3 and all(p.parent.name == "reference" for p in photos)


def test_a_reference_photo_outside_the_version_folder_is_not_read(tmp_path):
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    (tmp_path / "secret.jpg").write_bytes(b"x")
    names = add_reference_photos(version, {"ok.jpg": (ROOT / "samples" / "chelsea.jpg").read_bytes()})
    info = json.loads((version / "model_info.json").read_text())
    info["reference_photos"] = names + ["../../secret.jpg", "missing.jpg"]
    (version / "model_info.json").write_text(json.dumps(info))
    assert reference_photos(version) == [version.resolve() / "reference" / "ok.jpg"]
    assert decoded_reference(version, MAX_PIXELS)[0][1].pixels.shape == (300, 451, 3)


# -- for real: bf16 on this CPU ----------------------------------------------------------------------


@pytest.mark.skipif(not THIS_CPU.bf16_kernels, reason="TensorFlow's oneDNN has no bf16 kernels on this CPU")
@pytest.mark.parametrize("name", ["objects", "faces", "shapes"])
def test_bf16_passes_the_gate_on_each_shipped_models_photos_and_really_changes_the_arithmetic(name, fp32_after):
    detector = load_detector(MODELS / name)
    pixels = decoded_reference(detector.model.path, MAX_PIXELS)[0][1].pixels[None]
    apply_precision("fp32")
    plain = detector.run(pixels)[0]
    execution = settle_detector(detector, "bf16", True, 0.5, MAX_PIXELS)
    assert (execution.precision, execution.gate) == ("bf16", "passed"), execution.reason
    assert execution.parity["detections"] >= 2 and execution.parity["max_score_difference"] <= SCORE_TOLERANCE
    reduced = detector.run(pixels)[0]
    count = min(plain.count, reduced.count)
    # the rewrite reached TensorFlow: the scores moved, a little
    assert 0 < np.abs(plain.scores[:count] - reduced.scores[:count]).max() <= SCORE_TOLERANCE


def test_calibrate_measures_at_the_precision_the_model_will_run_at(fp32_after):
    """On the GPU stand-in, fp16 is settled on before the measured calls, as the model's worker would."""
    config = FakeTfConfig(gpus=1, compute_capability=(9, 0))
    seen = []
    detector = load_detector(MODELS / "shapes")

    class Watched:
        model, max_batch, image_shape = detector.model, detector.max_batch, detector.image_shape

        def run(self, batch):
            seen.append(config.options.get("auto_mixed_precision"))
            return detector.run(batch)

        detect = detector.detect

    result = measure(MemorySpec("growth"), "shapes", 0, 2, 64, 48, 3, nvml_library=FakeNvml(4321), tf_config=config,
                     tf_memory=lambda: [], load=lambda path: Watched(), pid=4321, interval_s=0.01,
                     execution={"asked": "fp16", "gate": True, "threshold": 0.5})
    assert result.precision == "fp16" and "fp16 asked, on NVIDIA H100" in result.precision_reason
    assert seen and all(seen)


# -- settings and serving ----------------------------------------------------------------------------


def test_precision_is_a_per_model_setting_and_a_bad_one_is_refused(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text('precision = "auto"\n[models.faces]\nprecision = "fp32"\nparity_gate = false\n')
    settings = load_settings(config_path=config, environ={})
    assert settings.for_model("faces").precision == "fp32" and not settings.for_model("faces").parity_gate
    assert settings.for_model("objects").precision == "auto" and settings.for_model("objects").parity_gate
    with pytest.raises(ConfigError, match="DETECT_PRECISION.*auto, fp32, bf16, fp16"):
        load_settings(config_path=config, environ={"DETECT_PRECISION": "fp64"})


def test_a_served_model_says_what_it_computes_at_in_models_metrics_and_its_config(tmp_path):
    """bf16 asked by name is not timed, so what it settles on depends on the CPU's flags alone, not its speed."""
    repository = tmp_path / "models"
    repository.mkdir()
    for name in ("objects", "shapes"):
        (repository / name).symlink_to(MODELS / name)
    config = tmp_path / "serve.toml"
    config.write_text('[models.objects]\nprecision = "bf16"\n[models.shapes]\nprecision = "fp32"\n')
    server = start_server({"DETECT_MODEL_REPOSITORY": str(repository), "DETECT_PRECISION": None,
                           "DETECT_SPARE_WORKERS": "0"}, tmp_path / "server.log", ["--config", str(config)])
    try:
        def get(path):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=30) as response:
                return response.read().decode()

        objects = json.loads(get("/models/objects"))["execution"]
        shapes = json.loads(get("/models/shapes"))["execution"]
        assert (shapes["precision"], shapes["asked"], shapes["gate"]) == ("fp32", "fp32", "none")
        expected = choose_precision("bf16", THIS_CPU)[0]
        if expected == "bf16":
            assert (objects["precision"], objects["asked"], objects["gate"]) == ("bf16", "bf16", "passed")
            assert objects["parity"]["photos"] == 4 and objects["parity"]["detections"] >= 8
            assert not objects["parity"]["problems"] and objects["speedup"] is None  # asked by name: not timed
        else:  # no bf16 kernels: served, and said, as fp32
            assert (objects["precision"], objects["gate"]) == ("fp32", "none")
            assert "no bf16 kernels" in objects["reason"]
        metrics = get("/metrics")
        assert (f'detect_model_precision_info{{asked="bf16",gate="{objects["gate"]}",model="objects",'
                f'precision="{expected}",version="1"}} 1.0') in metrics
        accelerators = [{"name": "auto_mixed_precision_onednn_bfloat16"}] if expected == "bf16" else []
        config = json.loads(get("/v2/models/objects/config"))
        assert config.get("optimization", {}).get("execution_accelerators", {}).get(
            "cpu_execution_accelerator", []) == accelerators
        assert "optimization" not in json.loads(get("/v2/models/shapes/config"))
        import tritonclient.grpc as triton

        with triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:  # the same, over gRPC
            over_grpc = client.get_model_config("objects").config.optimization.execution_accelerators
        assert [{"name": a.name} for a in over_grpc.cpu_execution_accelerator] == accelerators
        assert f"model objects executes in {expected}: bf16 asked" in server.log_path.read_text()
        for action in ("unload", "load"):  # a reload of the same version applies the first load's choice again
            request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v2/repository/models/objects/{action}",
                                             data=b"{}", method="POST", headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=60).read()
        assert json.loads(get("/models/objects"))["execution"] == {**objects, "carried_over": True}
    finally:
        server.stop()


def test_the_measurement_tool_times_each_mode_side_by_side_and_compares_their_answers(tmp_path):
    """tools/precision.py, briefly: each mode in a child of its own, then one table (docs/measured.md's)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tools.precision", "--models", "shapes", "--modes", "fp32,bf16",
                           "--seconds", "0.2", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    runs = {run["mode"]: run for run in result["runs"]}
    assert set(runs["fp32"]["ms_per_image"]) == set(runs["bf16"]["ms_per_image"]) == {"1", "4", "16"}
    assert runs["bf16"]["parity"]["matched"] == runs["bf16"]["parity"]["detections"] >= 15
    assert "precision: shapes bf16 batch 16:" in done.stderr  # progress, as it goes
    table = (tmp_path / "results.md").read_text()
    assert "| shapes | bf16 | 3 | " in table and re.search(r"\| shapes \| bf16 \| [\d.]+ \([\d.]+x\)", table)
