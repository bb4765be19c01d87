"""Settings: precedence of defaults, TOML, environment and flags; strict validation at boot."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib

import pytest

from app.errors import ConfigError
from app.memory_policy import MemorySpec
from app.settings import Settings, load_settings

from conftest import ROOT


def test_defaults_apply_without_file_env_or_flags(tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    settings = load_settings(flags={}, config_path=empty, environ={})
    assert settings == Settings()
    assert settings.gpu_memory == MemorySpec(mode="cap", cap_mib=4096)


def test_shipped_default_config_matches_the_code_defaults():
    """config/default.toml documents the defaults; it must not drift from the code."""
    with (ROOT / "config" / "default.toml").open("rb") as handle:
        shipped = tomllib.load(handle)
    assert set(shipped) == {f.name for f in dataclasses.fields(Settings)}
    assert load_settings(config_path=ROOT / "config" / "default.toml", environ={}) == Settings()


def test_file_then_environment_then_flags_take_precedence(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('port = 9001\nhost = "0.0.0.0"\ngpu_memory = "growth"\nlog_level = "debug"\n')
    environ = {"DETECT_PORT": "9002", "DETECT_GPU_MEMORY": "25%", "PATH": "/bin"}
    settings = load_settings(flags={"port": "9003", "model": None}, config_path=config, environ=environ)
    assert settings.port == 9003  # flag beats environment beats file
    assert settings.gpu_memory == MemorySpec(mode="share", share_percent=25.0)  # environment beats file
    assert settings.host == "0.0.0.0"  # file beats default
    assert settings.log_level == "DEBUG"
    assert settings.model == Settings().model  # a flag given as None is not given


def test_sizes_and_gpu_lists_are_parsed():
    settings = load_settings(flags={"max_body_bytes": "3MiB", "gpus": "0,2"}, environ={})
    assert settings.max_body_bytes == 3 * 2**20
    assert settings.gpus == (0, 2)


@pytest.mark.parametrize(
    "source, fragment",
    [
        ({"DETECT_PORT": "eighty"}, "DETECT_PORT (--port), from DETECT_PORT, has value 'eighty': expected an integer from 0 to 65535"),
        ({"DETECT_PORT": "70000"}, "expected an integer from 0 to 65535"),
        ({"DETECT_GPU_MEMORY": "0"}, "a cap must be above 0 MiB"),
        ({"DETECT_GPU_MEMORY": "-5GiB"}, "expected 'greedy', 'growth'"),
        ({"DETECT_GPU_MEMORY": "150%"}, "at most 100%"),
        ({"DETECT_GPU_MEMORY": "lots"}, "DETECT_GPU_MEMORY (--gpu-memory)"),
        ({"DETECT_GPUS": "0,x"}, "GPU indices like '0' or '0,1'"),
        ({"DETECT_GPUS": "1,1"}, "distinct"),
        ({"DETECT_DEFAULT_THRESHOLD": "nan"}, "expected a number from 0 to 1"),
        ({"DETECT_MAX_BODY_BYTES": "20MB"}, "such as '20MiB'"),
        ({"DETECT_LOG_LEVEL": "loud"}, "expected one of DEBUG, INFO, WARNING, ERROR"),
        ({"DETECT_PROT": "8000"}, "environment variable DETECT_PROT is not a setting"),
    ],
)
def test_bad_environment_values_name_the_setting_value_and_what_is_allowed(source, fragment):
    with pytest.raises(ConfigError) as caught:
        load_settings(flags={}, environ=source)
    assert fragment in caught.value.message


def test_unknown_key_in_the_file_is_refused(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'prot'"):
        load_settings(config_path=config, environ={})


def test_unreadable_toml_is_refused(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("port = = 1\n")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_settings(config_path=config, environ={})


def _serve(*args, env=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "app", "serve", *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        (["--port", "abc"], {}, "DETECT_PORT (--port), from --port, has value 'abc'"),
        ([], {"DETECT_GPU_MEMORY": "101%"}, "DETECT_GPU_MEMORY (--gpu-memory), from DETECT_GPU_MEMORY, has value '101%'"),
        (["--config", "/nonexistent.toml"], {}, "config file /nonexistent.toml does not exist"),
        (["--model", "/nonexistent/model"], {}, "model path /nonexistent/model does not exist"),
    ],
)
def test_a_bad_value_stops_the_process_with_status_2_and_one_line(args, env, fragment):
    result = _serve(*args, env=env)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr
