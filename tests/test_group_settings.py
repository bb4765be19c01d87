"""Worker groups in the settings: a member takes its group's process-wide values, and one that contradicts
them stops the server at boot with status 2, naming the file, the models and the keys."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app.errors import ConfigError
from app.gpu.memory_policy import parse_memory_spec
from app.settings import load_settings

from conftest import ROOT

GROUPED = """
[models.shapes]
worker_group = "small"
[models.faces]
worker_group = "small"
max_queue = 7
[groups.small]
gpu_memory = "3GiB"
gpus = "0"
"""


def _config(tmp_path, text: str):
    path = tmp_path / "groups.toml"
    path.write_text(text)
    return path


def test_members_take_the_groups_cap_and_gpus_and_keep_their_own_other_settings(tmp_path):
    settings = load_settings(config_path=_config(tmp_path, GROUPED), environ={})
    shapes, faces, objects = (settings.for_model(n) for n in ("shapes", "faces", "objects"))
    assert shapes.worker_group == faces.worker_group == "small" and objects.worker_group == ""
    assert shapes.gpu_memory == faces.gpu_memory == parse_memory_spec("3GiB")
    assert shapes.gpus == faces.gpus == (0,)
    assert faces.max_queue == 7 and shapes.max_queue == 128
    assert objects.gpu_memory == parse_memory_spec("4GiB") and objects.gpus is None  # not a member: as before


def test_the_server_wide_worker_group_puts_every_model_in_one_group(tmp_path):
    settings = load_settings(config_path=_config(tmp_path, "[groups.all]\ngpu_memory = '6GiB'\n"),
                             environ={"DETECT_WORKER_GROUP": "all"})
    assert {settings.for_model(n).worker_group for n in ("objects", "shapes")} == {"all"}
    assert settings.for_model("objects").gpu_memory == parse_memory_spec("6GiB")


@pytest.mark.parametrize("table, keys", [
    ('gpu_memory = "1GiB"', "gpu_memory"),
    ('gpus = "1"', "gpus"),
    ('gpu_memory = "1GiB"\ngpus = "none"', "gpu_memory, gpus"),
])
def test_a_member_setting_another_process_wide_value_is_refused_naming_file_models_and_keys(tmp_path, table, keys):
    path = _config(tmp_path, GROUPED.replace("[models.faces]\n", f"[models.faces]\n{table}\n"))
    with pytest.raises(ConfigError) as caught:
        load_settings(config_path=path, environ={})
    message = caught.value.message
    assert str(path) in message and "faces" in message and "'small'" in message and f"set {keys} " in message


def test_a_member_repeating_its_groups_value_is_no_conflict(tmp_path):
    path = _config(tmp_path, GROUPED.replace("[models.faces]\n", '[models.faces]\ngpu_memory = "3GiB"\n'))
    assert load_settings(config_path=path, environ={}).for_model("faces").gpu_memory == parse_memory_spec("3GiB")


@pytest.mark.parametrize("text, fragment", [
    ("[groups.small]\nmax_queue = 3\n", "[groups.small] has unknown key 'max_queue'"),
    ("[groups.'bad name']\ngpu_memory = '1GiB'\n", "does not name a worker group"),
    ("[models.shapes]\nworker_group = 'a b'\n", "expected a group name"),
])
def test_a_bad_group_table_is_refused(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as caught:
        load_settings(config_path=_config(tmp_path, text), environ={})
    assert fragment in caught.value.message


def test_a_conflicting_member_stops_the_server_at_boot_with_status_2(tmp_path):
    path = _config(tmp_path, GROUPED.replace("[models.shapes]\n", '[models.shapes]\ngpu_memory = "2GiB"\n'))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    result = subprocess.run([sys.executable, "-m", "app", "serve", "--config", str(path), "--port", "0"], cwd=ROOT,
                            env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    line = next(line for line in result.stderr.splitlines() if line.startswith("error:"))
    assert str(path) in line and "shapes" in line and "gpu_memory" in line and "[groups.small]" in line
    assert "Traceback" not in result.stderr


def test_a_greedy_group_is_not_refused_for_its_members_sharing_one_gpu(tmp_path):
    from app.hosting.serve import check_shared_policies

    settings = load_settings(config_path=_config(tmp_path, GROUPED.replace('gpu_memory = "{cap}"', "")
                                                 .replace('gpu_memory = "3GiB"', 'gpu_memory = "greedy"')),
                             environ={})
    check_shared_policies(settings, ["faces", "shapes"])  # one worker: nothing to budget beside it
    with pytest.raises(ConfigError, match="may share a GPU with model"):
        check_shared_policies(settings, ["faces", "shapes", "objects"])
