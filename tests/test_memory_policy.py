"""The memory policy: parsing DETECT_GPU_MEMORY / DETECT_GPUS, and what apply_policy asks of tf.config."""

from __future__ import annotations

import logging

import pytest

from app.errors import PolicyError
from app.gpu.memory_policy import MemorySpec, apply_policy, parse_gpu_list, parse_memory_spec

from fake_tf_config import FakeTfConfig


@pytest.mark.parametrize(
    "text, expected",
    [
        ("greedy", MemorySpec("greedy")),
        (" Growth ", MemorySpec("growth")),
        ("4096", MemorySpec("cap", cap_mib=4096)),
        ("4096MiB", MemorySpec("cap", cap_mib=4096)),
        ("4GiB", MemorySpec("cap", cap_mib=4096)),
        ("1.5GiB", MemorySpec("cap", cap_mib=1536)),
        ("512m", MemorySpec("cap", cap_mib=512)),
        ("25%", MemorySpec("share", share_percent=25.0)),
        ("100%", MemorySpec("share", share_percent=100.0)),
        ("12.5 %", MemorySpec("share", share_percent=12.5)),
    ],
)
def test_memory_specs_parse(text, expected):
    assert parse_memory_spec(text) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("0", "above 0 MiB"),
        ("0GiB", "above 0 MiB"),
        ("-1", "expected 'greedy'"),
        ("0%", "above 0%"),
        ("100.5%", "at most 100%"),
        ("1.3MiB", "whole number of MiB"),
        ("4GB", "expected 'greedy'"),
        ("", "expected 'greedy'"),
        ("half", "expected 'greedy'"),
    ],
)
def test_bad_memory_specs_say_what_is_allowed(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_memory_spec(text)


def test_memory_spec_prints_as_it_would_be_written():
    assert [str(parse_memory_spec(t)) for t in ("4GiB", "25%", "growth")] == ["4096MiB", "25%", "growth"]


@pytest.mark.parametrize("text, expected", [("", None), ("all", None), ("none", ()), ("0", (0,)), ("2, 0", (2, 0))])
def test_gpu_lists_parse(text, expected):
    assert parse_gpu_list(text) == expected


def test_a_cap_is_set_as_a_logical_device_on_each_selected_gpu():
    config = FakeTfConfig(gpus=3)
    policy = apply_policy(parse_memory_spec("4GiB"), gpus=(0, 2), total_mib=lambda i: 81559, tf_config=config)
    assert config.calls == [
        ("set_visible_devices", ["/physical_device:GPU:0", "/physical_device:GPU:2"], "GPU"),
        ("set_logical_device_configuration", "/physical_device:GPU:0", [4096]),
        ("set_logical_device_configuration", "/physical_device:GPU:2", [4096]),
    ]
    assert [(g.index, g.cap_mib, g.total_mib) for g in policy.gpus] == [(0, 4096, 81559), (2, 4096, 81559)]
    assert policy.to_json()["mode"] == "cap"


def test_growth_sets_memory_growth_and_no_cap():
    config = FakeTfConfig(gpus=2)
    policy = apply_policy(parse_memory_spec("growth"), tf_config=config)
    assert ("set_memory_growth", "/physical_device:GPU:1", True) in config.calls
    assert not [c for c in config.calls if c[0] == "set_logical_device_configuration"]
    assert [g.cap_mib for g in policy.gpus] == [None, None]


def test_greedy_changes_nothing_but_visibility():
    config = FakeTfConfig(gpus=1)
    apply_policy(parse_memory_spec("greedy"), tf_config=config)
    assert [c[0] for c in config.calls] == ["set_visible_devices"]


def test_a_share_is_taken_of_each_gpus_total_from_nvml():
    config = FakeTfConfig(gpus=2)
    totals = {0: 143771, 1: 24564}
    policy = apply_policy(parse_memory_spec("25%"), total_mib=totals.get, tf_config=config)
    assert [g.cap_mib for g in policy.gpus] == [35942, 6141]
    assert ("set_logical_device_configuration", "/physical_device:GPU:1", [6141]) in config.calls


def test_a_share_without_nvml_is_a_boot_error():
    with pytest.raises(PolicyError, match="needs NVML"):
        apply_policy(parse_memory_spec("25%"), tf_config=FakeTfConfig(gpus=1))


def test_a_cap_larger_than_the_gpu_is_a_boot_error():
    with pytest.raises(PolicyError, match="larger than GPU 0, which has 8192 MiB"):
        apply_policy(parse_memory_spec("10GiB"), total_mib=lambda i: 8192, tf_config=FakeTfConfig(gpus=1))


def test_selecting_a_gpu_that_does_not_exist_is_a_boot_error():
    with pytest.raises(PolicyError, match="asks for GPU 3, but TensorFlow sees 2"):
        apply_policy(parse_memory_spec("1GiB"), gpus=(3,), tf_config=FakeTfConfig(gpus=2))


def test_selecting_no_gpu_hides_them_all():
    config = FakeTfConfig(gpus=2)
    policy = apply_policy(parse_memory_spec("1GiB"), gpus=(), tf_config=config)
    assert config.calls == [("set_visible_devices", [], "GPU")]
    assert policy.gpus == () and "DETECT_GPUS=none" in policy.note


@pytest.mark.parametrize("spec", ["growth", "2GiB", "greedy"])
def test_an_already_initialized_tensorflow_fails_loudly(spec):
    with pytest.raises(PolicyError, match="already initialized"):
        apply_policy(parse_memory_spec(spec), tf_config=FakeTfConfig(gpus=1, initialized=True))


def test_on_this_gpu_less_host_the_real_tensorflow_gets_nothing_to_apply(caplog):
    """The no-GPU path against real TensorFlow: one log line, then the CPU."""
    with caplog.at_level(logging.INFO, logger="app.gpu.memory_policy"):
        policy = apply_policy(parse_memory_spec("4GiB"))
    assert policy.gpus == ()
    assert "no GPU is visible to TensorFlow" in policy.note
    lines = [r.getMessage() for r in caplog.records if r.name == "app.gpu.memory_policy"]
    assert len(lines) == 1 and "nothing to apply" in lines[0]
