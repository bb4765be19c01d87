"""The fleet: its file's validation, the GPU budget, and a real fleet of instances on this CPU."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.errors import ConfigError
from app.fleet.cli import Fleet, gpu_inventory
from app.fleet.plan import Gpu, load_fleet, make_plan, parse_fleet, planning_gpus

from conftest import ROOT, wait_for
from fake_nvml import FakeNvml
from images_for_tests import encode
from blob_model import blob_image

FACES = {"name": "faces", "model": "models/faces", "port": 8001, "gpu_memory": "4GiB"}
SHAPES = {"name": "shapes", "model": "models/shapes", "port": 8002, "gpu_memory": "2GiB"}


def _config(*instances, **top):
    return parse_fleet({**top, "instance": [dict(i) for i in instances]}, Path("fleet.toml"))


def _fleet_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "app", "fleet", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


# The file.

def test_the_shipped_example_is_faces_and_shapes_on_8001_and_8002():
    config = load_fleet(ROOT / "config" / "fleet.toml")
    assert [(i.name, i.model, i.port) for i in config.instances] == [
        ("faces", "models/faces", 8001), ("shapes", "models/shapes", 8002)]
    assert config.gpu_overhead_mib == 1024


@pytest.mark.parametrize(
    "top, instances, fragment",
    [
        ({"gpu_overhed_mib": 5}, [FACES], "unknown key 'gpu_overhed_mib'; known keys: gpu_overhead_mib"),
        ({"gpu_overhead_mib": -1}, [FACES], "gpu_overhead_mib has value -1: expected an integer from 0 to 65536"),
        ({"gpu_overhead_mib": "500"}, [FACES], "gpu_overhead_mib has value '500'"),
        ({}, [], "lists no instance"),
        ({}, [{**FACES, "gpu_mem": "4GiB"}], "instance 1 ('faces') has unknown key 'gpu_mem'; known keys: name, host"),
        ({}, [FACES, {**SHAPES, "name": "faces"}], "instances 1 and 2 are both named 'faces'"),
        ({}, [FACES, {**SHAPES, "port": 8001}], "instances 'faces' and 'shapes' both ask for port 8001"),
        ({}, [{**FACES, "gpu_memory": "lots"}], "instance 1 ('faces'): gpu_memory has value 'lots': expected 'greedy'"),
        ({}, [{**FACES, "gpu_memory": "150%"}], "at most 100%"),
        ({}, [{**FACES, "gpus": "0,0"}], "gpus has value '0,0': GPU indices must be distinct"),
        ({}, [{**FACES, "port": 70000}], "port has value 70000: expected an integer from 0 to 65535"),
        ({}, [{k: v for k, v in FACES.items() if k != "port"}], "lacks port"),
        ({}, [{**FACES, "name": "other"}], "kept for processes of no instance"),
        ({}, [{**FACES, "name": "a b"}], "must be letters, digits"),
        ({}, [{**FACES, "fleet_state": "/tmp/x"}], "fleet_state is set by the fleet itself"),
    ],
)
def test_a_bad_fleet_file_is_refused_naming_the_key_and_what_is_allowed(top, instances, fragment):
    with pytest.raises(ConfigError) as caught:
        _config(*instances, **top)
    assert fragment in caught.value.message


def test_a_single_instance_table_is_refused_with_the_right_syntax(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text('[instance]\nname = "a"\nmodel = "m"\nport = 1\n')
    with pytest.raises(ConfigError, match=r"write each instance as \[\[instance\]\]"):
        load_fleet(path)


def test_an_instance_setting_reaches_its_process_as_detect_variables():
    (instance,) = _config({**FACES, "http_threads": 4, "gpus": "0"}).instances
    env = instance.env()
    assert env["DETECT_HTTP_THREADS"] == "4" and env["DETECT_GPU_MEMORY"] == "4096MiB"
    assert (env["DETECT_PORT"], env["DETECT_MODEL"], env["DETECT_GPUS"]) == ("8001", "models/faces", "0")
    assert env["DETECT_GRPC_PORT"] == "off"  # serve's default, 8001, is one port: an instance has one if it asks


def test_an_instances_grpc_port_is_its_own_and_collides_with_no_other_port():
    (instance,) = _config({**FACES, "grpc_port": 9001}).instances
    assert instance.env()["DETECT_GRPC_PORT"] == "9001"
    with pytest.raises(ConfigError, match="'faces' and 'shapes' both ask for port 8001"):
        _config({**FACES, "grpc_port": 9001}, {**SHAPES, "grpc_port": 8001})
    with pytest.raises(ConfigError, match="asks for port 8001 for both HTTP and gRPC"):
        _config({**FACES, "grpc_port": 8001})


# The budget.

def test_a_plan_that_fits_gives_each_instance_its_cap_plus_overhead():
    plan = make_plan(_config(FACES, SHAPES), planning_gpus(_config(FACES, SHAPES), 16384))
    assert plan.fits and not plan.warnings
    assert [(p.instance.name, p.gpu, p.cap_mib, p.budget_mib) for p in plan.placements] == [
        ("faces", 0, 4096, 5120), ("shapes", 0, 2048, 3072)]
    (budget,) = plan.budgets
    assert budget.needed_mib == 8192 and "fits" in budget.describe()


def test_an_over_budget_plan_names_the_mib_needed_available_and_the_instances():
    config = _config(FACES, SHAPES)
    plan = make_plan(config, planning_gpus(config, 8000))
    (error,) = plan.errors
    assert "GPU 0 is over budget: the plan needs 8192 MiB" in error and "8000 MiB are available" in error
    assert "faces (4096 MiB), shapes (2048 MiB)" in error


def test_greedy_on_a_shared_gpu_is_refused_but_alone_it_is_fine():
    greedy = {**FACES, "gpu_memory": "greedy"}
    shared = make_plan(_config(greedy, SHAPES), [Gpu(0, 16384)])
    assert any("'faces' is greedy" in e and "would starve" in e for e in shared.errors)
    apart = make_plan(_config({**greedy, "gpus": "0"}, {**SHAPES, "gpus": "1"}), [Gpu(0, 16384), Gpu(1, 16384)])
    assert apart.fits, apart.errors
    assert not make_plan(_config(greedy, SHAPES), None).fits  # no GPU known: they may still share one


def test_growth_is_allowed_with_a_warning_that_it_is_unbounded():
    plan = make_plan(_config(FACES, {**SHAPES, "gpu_memory": "growth"}), [Gpu(0, 16384)])
    assert plan.fits
    (warning,) = plan.warnings
    assert "'shapes' uses memory growth: its GPU memory is unbounded" in warning
    assert plan.budgets[0].needed_mib == 4096 + 2 * 1024


def test_a_share_resolves_against_each_gpus_total_as_the_instance_would():
    """25% of an H200 (143771 MiB) is 35942 MiB, the cap apply_policy sets; reserved memory is not available."""
    config = _config({**FACES, "gpu_memory": "25%"}, {**SHAPES, "gpu_memory": "80%"})
    gpus, reason = gpu_inventory(config, None, nvml_library=FakeNvml(1234))
    assert reason is None and [(g.index, g.total_mib, g.available_mib) for g in gpus] == [
        (0, 143771, 143216), (1, 143771, 143216)]
    plan = make_plan(config, gpus)
    assert plan.caps_for("faces") == {0: 35942, 1: 35942}
    assert not plan.fits and "needs 153006 MiB" in plan.errors[0] and "143216 MiB are available" in plan.errors[0]


def test_an_instance_on_a_gpu_the_plan_lacks_is_refused():
    plan = make_plan(_config({**FACES, "gpus": "3"}), [Gpu(0, 16384)])
    assert "asks for GPU 3, but the plan has GPU(s) 0" in plan.errors[0]


def test_dry_run_prints_the_plan_and_exits_0_when_it_fits_2_when_not():
    fits = _fleet_cli("--config", "config/fleet.toml", "--dry-run", "--gpu-total-mib", "16384")
    assert fits.returncode == 0, fits.stderr
    header, faces, shapes = fits.stdout.splitlines()[:3]
    assert header.split() == ["instance", "port", "gRPC", "model", "GPU", "cap", "budget"]
    assert faces.split() == ["faces", "8001", "9001", "models/faces", "0", "4096", "MiB", "5120", "MiB"]
    assert "needs 8192 MiB" in fits.stdout and "16384 MiB available -> fits" in fits.stdout
    over = _fleet_cli("--config", "config/fleet.toml", "--dry-run", "--gpu-total-mib", "6000")
    assert over.returncode == 2
    assert "the plan needs 8192 MiB" in over.stderr and "6000 MiB are available" in over.stderr


def test_the_fleet_plans_where_flask_is_not_installed():
    """Reading settings (restricted_api among them) imports no Flask: a GPU host without the HTTP stack can plan.

    The first run of scripts/gpu-check on a real GPU (an H200 without Flask) found the dry run failing here.
    """
    script = ("import runpy, sys; sys.modules['flask'] = None; sys.argv[0] = 'app'; "
              "runpy.run_module('app', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", script, "fleet", "--config", "config/fleet.toml", "--dry-run",
                             "--gpu-total-mib", "16384"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "-> fits" in result.stdout and "Traceback" not in result.stderr


def test_a_bad_fleet_file_exits_2_before_starting_anything(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text('[[instance]]\nname = "a"\nmodel = "m"\nport = 1\ngpu_memory = "lots"\n')
    result = _fleet_cli("--config", str(path))
    assert result.returncode == 2 and "gpu_memory has value 'lots'" in result.stderr
    assert "started as pid" not in result.stderr


# Supervising, with processes that need no TensorFlow.

def test_an_instance_that_keeps_failing_is_given_up_after_max_failures(tmp_path):
    config = _config({**FACES, "port": 0}, max_failures=3, restart_backoff_s=0.0)
    plan = make_plan(config, None)
    out, err = io.StringIO(), io.StringIO()
    fleet = Fleet(config, plan, tmp_path / "state.json", dict(os.environ),
                  command=[sys.executable, "-c", "print('boot'); import sys; sys.exit(1)"], out=out, err=err)
    fleet.start_all()
    deadline = time.monotonic() + 30
    while not fleet.all_failed() and time.monotonic() < deadline:
        fleet.poll()
        time.sleep(0.05)
    assert fleet.all_failed()
    (child,) = fleet.children
    assert child.restarts == 2 and len(child.exits) == 3
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["instances"][0]["state"] == "failed" and state["instances"][0]["pid"] is None
    fleet.stop()
    assert err.getvalue().count("faces | boot") == 3  # each run's output, prefixed with the instance's name
    assert out.getvalue().splitlines()[-1].split() == ["faces", "-", "models/faces", "4096", "MiB", "-", "failed"]


# A real fleet: two instances of the blob model serving at once, one killed and restarted, then SIGTERM.

def _state(path: Path) -> dict:
    try:
        return {i["name"]: i for i in json.loads(path.read_text())["instances"]}
    except (OSError, ValueError):
        return {}


def _detect(port: int, body: bytes) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/detect", body=body, headers={"Content-Type": "image/png"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_a_real_fleet_serves_two_instances_restarts_one_after_kill_9_and_stops_on_sigterm(blob_model_dir, tmp_path):
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(f"""
restart_backoff_s = 0.2
[[instance]]
name = "red"
model = "{blob_model_dir}"
port = 0
gpu_memory = "1GiB"
[[instance]]
name = "green"
model = "{blob_model_dir}"
port = 0
gpu_memory = "growth"
http_threads = 4
[[instance]]
name = "broken"
model = "{tmp_path / 'no-such-model'}"
port = 0
""")
    state_path, out, err = tmp_path / "state.json", tmp_path / "out.txt", tmp_path / "err.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        fleet = subprocess.Popen([sys.executable, "-m", "app", "fleet", "--config", str(fleet_file),
                                  "--state", str(state_path)], cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
    try:
        states = wait_for(lambda: (s := _state(state_path)) and s["red"]["state"] == s["green"]["state"] == "ready"
                           and s["broken"]["state"] == "failed" and s, 180, "both instances ready", err)
        red, green = states["red"], states["green"]
        assert red["port"] != green["port"] and red["pid"] != green["pid"]

        # Both serve at once, each on its own port.
        image = encode(blob_image(64, 48, {1: (4, 6, 20, 30)}), "PNG")
        answers: dict = {}
        threads = [threading.Thread(target=lambda n=n: answers.__setitem__(n, _detect(states[n]["port"], image)))
                   for n in ("red", "green")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for name in ("red", "green"):
            status, body = answers[name]
            assert status == 200 and body["detections"][0]["class_id"] == 1, body

        # Each instance's /gpu reads the fleet's state file and knows itself by name.
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", green["port"], timeout=30)
        conn.request("GET", "/gpu")
        gpu = json.loads(conn.getresponse().read())
        conn.close()
        accounting = gpu["accounting"]
        assert gpu["instance"] == "green" and [w["model"] for w in gpu["workers"]] == ["blob"]
        conn = http.client.HTTPConnection("127.0.0.1", green["port"], timeout=30)
        conn.request("GET", "/readyz")  # a user's probe: logged, unlike the fleet's own every 200 ms
        assert conn.getresponse().status == 200
        conn.close()
        assert accounting["fleet"] is not None and "red" in json.dumps(accounting["fleet"])

        table = wait_for(lambda: "pid" in out.read_text() and out.read_text(), 10, "the table", err)
        assert [line.split()[0] for line in table.splitlines()[-4:]] == ["instance", "red", "green", "broken"]
        assert str(red["pid"]) in table and "ready" in table and "failed" in table

        os.kill(red["pid"], signal.SIGKILL)
        again = wait_for(lambda: (s := _state(state_path)) and s["red"]["state"] == "ready"
                          and s["red"]["pid"] not in (None, red["pid"]) and s, 120, "red restarted", err)
        assert again["red"]["restarts"] == 1 and again["green"]["pid"] == green["pid"]
        assert _detect(again["red"]["port"], image)[0] == 200

        fleet.send_signal(signal.SIGTERM)
        assert fleet.wait(60) == 0
    finally:
        if fleet.poll() is None:  # the test failed: leave no process behind
            fleet.kill()
            fleet.wait()
            for instance in _state(state_path).values():
                if instance["pid"]:
                    try:
                        os.kill(instance["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    log = err.read_text(errors="replace")
    assert f"instance red (pid {red['pid']}) was killed by SIGKILL; restarting in" in log
    assert "instance broken" in log and "exited with status 2" in log and "the other instances keep running" in log
    assert log.count("caps cannot be enforced") == 1 or os.path.exists("/dev/nvidiactl")
    for pid in (again["red"]["pid"], green["pid"]):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "Traceback" not in log
    # The fleet's readiness polls of red (twice) and green are not access lines; the user's /readyz is.
    assert re.findall(r"app\.access: GET /readyz .*", log) == [re.search(r"app\.access: GET /readyz 200 .*", log)[0]]
    final = _state(state_path)
    assert {s["state"] for s in final.values()} == {"stopped"}
