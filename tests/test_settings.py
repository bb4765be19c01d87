"""Settings: precedence of defaults, TOML, environment and flags; strict validation at boot."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

from app.errors import ConfigError
from app.gpu.memory_policy import MemorySpec
from app.settings import Settings, load_settings, setting_fields

from conftest import ROOT


def test_defaults_apply_without_file_env_or_flags(tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    settings = load_settings(flags={}, config_path=empty, environ={})
    assert settings == Settings()
    assert settings.gpu_memory == MemorySpec(mode="cap", cap_mib=4096)


def test_shipped_default_config_matches_the_code_defaults():
    """config/default.toml documents every default; it sets only the default model and shapes' cap apart."""
    with (ROOT / "config" / "default.toml").open("rb") as handle:
        shipped = tomllib.load(handle)
    documented = {f.name for f in setting_fields()} - {"model", "notify_fd"}  # one-model mode; the fleet's own
    assert set(shipped) == documented | {"models"}
    loaded = load_settings(config_path=ROOT / "config" / "default.toml", environ={})
    assert loaded == Settings(default_model="objects", model_overrides=(
        ("shapes", (("gpu_memory", MemorySpec(mode="cap", cap_mib=2048)),)),))


def test_a_models_table_overrides_the_file_for_one_model_and_the_environment_overrides_both(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('gpu_memory = "4GiB"\nmax_queue = 64\n[models.shapes]\ngpu_memory = "1GiB"\n'
                      'max_batch_size = 4\nidle_unload_s = 0\npreload = false\n')
    settings = load_settings(config_path=config, environ={})
    shapes, faces = settings.for_model("shapes"), settings.for_model("faces")
    assert (shapes.gpu_memory.cap_mib, shapes.max_batch_size, shapes.idle_unload_s, shapes.preload) == (1024, 4, 0, False)
    assert (faces.gpu_memory.cap_mib, faces.max_batch_size, faces.preload) == (4096, 16, True)
    assert shapes.max_queue == faces.max_queue == 64  # not in the table: the server-wide value
    overridden = load_settings(config_path=config, environ={"DETECT_GPU_MEMORY": "3GiB"}).for_model("shapes")
    assert overridden.gpu_memory.cap_mib == 3072 and overridden.max_batch_size == 4


@pytest.mark.parametrize(
    "table, fragment",
    [
        ('[models.shapes]\nport = 1\n', "[models.shapes] has unknown key 'port'; a model's table may set gpu_memory"),
        ('[models.shapes]\ngpu_memory = "lots"\n', "from gpu_memory in [models.shapes] of"),
        ('[models.shapes]\ninference_threads = 0\n', "expected an integer from 1 to 64"),
        ('[models.shapes]\npreload = "maybe"\n', "expected true or false"),
        ('models = 3\n', "'models' must hold one [models.<name>] table per model"),
        ('[models."a b"]\n', "does not name a model"),
    ],
)
def test_a_bad_models_table_is_refused_naming_the_file_the_model_and_the_key(tmp_path, table, fragment):
    config = tmp_path / "c.toml"
    config.write_text(table)
    with pytest.raises(ConfigError) as caught:
        load_settings(config_path=config, environ={})
    assert fragment in caught.value.message and str(config) in caught.value.message


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


@pytest.mark.parametrize("raw, expected", [("false", False), ("OFF", False), ("0", False), (" no ", False),
                                           ("true", True), ("On", True), ("1", True), ("yes", True)])
def test_decode_at_model_size_takes_the_usual_words_for_on_and_off(raw, expected):
    assert load_settings(flags={"decode_at_model_size": raw}, environ={}).decode_at_model_size is expected


def test_a_toml_boolean_is_taken_as_it_is(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("decode_at_model_size = false\n")
    assert load_settings(config_path=config, environ={}).decode_at_model_size is False


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
        ({"DETECT_DECODE_AT_MODEL_SIZE": "maybe"}, "has value 'maybe': expected true or false"),
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
        (["--model-repository", "/nonexistent/repo"], {}, "model repository /nonexistent/repo does not exist"),
        (["--config", "config/default.toml", "--default-model", "nope"], {},
         "DETECT_DEFAULT_MODEL (--default-model) names 'nope', which is not a model"),
    ],
)
def test_a_bad_value_stops_the_process_with_status_2_and_one_line(args, env, fragment):
    result = _serve(*args, env=env)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr
