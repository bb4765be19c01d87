"""Every model in its own worker process, behind one server: routes, crashes, idle unloads, turns, versions.

Each test starts a real server on a repository that the test builds from the blob detector.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from blob_model import blob_image, build_blob_model
from conftest import ROOT, start_server, wait_for
from images_for_tests import encode

RED = encode(blob_image(40, 30, {1: (4, 6, 20, 18)}))
PNG = {"Content-Type": "image/png"}


def _repository(root: Path, source: Path, *names: str) -> Path:
    """Build a repository of blob models under the given names, each with version 1."""
    for name in names:
        shutil.copytree(source, root / name / "1")
    return root


@pytest.fixture
def repository(tmp_path, blob_model_dir) -> Path:
    return _repository(tmp_path / "repo", blob_model_dir / "2", "alpha", "beta")


def _models(server) -> dict:
    return {m["name"]: m for m in server.request("GET", "/models")[2]["models"]}


def _metric(server, series: str) -> float:
    text = server.request("GET", "/metrics")[2].decode()
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class Load:
    """Requests sent back to back from a few threads until stopped; every status and answering version kept."""

    def __init__(self, server, path: str, threads: int = 4):
        self.answers: list[tuple[int, object]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(server, path)) for _ in range(threads)]

    def _send(self, server, path):
        while not self._stop.is_set():
            status, _, body = server.request("POST", path, RED, PNG)
            self.answers.append((status, body["model"]["version"] if status == 200 else body))

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join(90)

    def failures(self) -> list:
        return [a for a in self.answers if a[0] != 200]


def test_two_models_answer_on_their_own_routes_each_from_its_own_worker(repository, tmp_path):
    server = start_server({"DETECT_MODEL_REPOSITORY": str(repository), "DETECT_DEFAULT_MODEL": "beta"},
                          tmp_path / "log")
    try:
        for name in ("alpha", "beta"):
            status, _, answer = server.request("POST", f"/models/{name}/detect", RED, PNG)
            assert status == 200 and answer["model"] == {"name": name, "version": "1"}
            assert [d["class_id"] for d in answer["detections"]] == [1]
        assert server.request("POST", "/detect", RED, PNG)[2]["model"]["name"] == "beta"
        models = _models(server)
        assert {m["state"] for m in models.values()} == {"ready"}
        pids = {models["alpha"]["pid"], models["beta"]["pid"], server.process.pid}
        assert len(pids) == 3  # a worker each, neither of them the HTTP process
        assert models["alpha"]["versions"] == [{"version": "1", "state": "ready"}]
        assert models["alpha"]["memory"]["source"] == "rss" and models["alpha"]["memory"]["used_mib"] > 50
        status, _, one = server.request("GET", "/models/beta")
        assert status == 200 and one["name"] == "beta" and one["pid"] == models["beta"]["pid"]
        status, _, missing = server.request("POST", "/models/gamma/detect", RED, PNG)
        assert status == 404 and missing["error"]["code"] == "model_not_found"
        assert "alpha, beta" in missing["error"]["message"]
    finally:
        assert server.stop() == 0
    for pid in pids - {server.process.pid}:
        assert _gone(pid), f"worker {pid} outlived the server"
    assert "Traceback" not in server.log()


def test_the_http_process_never_loads_tensorflow_and_its_workers_do(repository, tmp_path):
    server = start_server({"DETECT_MODEL_REPOSITORY": str(repository), "DETECT_DEFAULT_MODEL": "alpha"},
                          tmp_path / "log")
    try:
        worker = _models(server)["alpha"]["pid"]
        mine = Path(f"/proc/{server.process.pid}/maps").read_text()
        theirs = Path(f"/proc/{worker}/maps").read_text()
        assert "libtensorflow" in theirs  # the check can see TensorFlow where it is
        assert "libtensorflow" not in mine and "_pywrap_tensorflow" not in mine
    finally:
        server.stop()


def test_kill_9_of_a_worker_under_load_fails_no_request_and_other_models_do_not_notice(repository, tmp_path):
    server = start_server({"DETECT_MODEL_REPOSITORY": str(repository), "DETECT_DEFAULT_MODEL": "alpha",
                           "DETECT_RESTART_BACKOFF_S": "0.2"}, tmp_path / "log")
    try:
        before = _models(server)
        with Load(server, "/models/alpha/detect") as alpha, Load(server, "/models/beta/detect", 2) as beta:
            wait_for(lambda: len(alpha.answers) > 20, 30, "answers before the kill")
            os.kill(before["alpha"]["pid"], signal.SIGKILL)
            wait_for(lambda: (m := _models(server)["alpha"])["state"] == "ready" and m["pid"] != before["alpha"]["pid"],
                      60, "alpha restarted", server.log_path)
            seen = len(alpha.answers)
            wait_for(lambda: len(alpha.answers) > seen + 20, 30, "answers after the restart")
        assert alpha.failures() == [] and beta.failures() == []
        after = _models(server)
        assert after["beta"]["pid"] == before["beta"]["pid"] and after["beta"]["loads"] == 1
        assert _metric(server, 'detect_worker_restarts_total{model="alpha"}') == 1.0
        assert _metric(server, 'detect_worker_restarts_total{model="beta"}') == 0.0
    finally:
        assert server.stop() == 0
    assert "was killed by SIGKILL" in server.log() and "Traceback" not in server.log()


def test_an_idle_model_gives_its_worker_back_and_the_next_request_loads_it(repository, tmp_path):
    server = start_server({"DETECT_MODEL_REPOSITORY": str(repository), "DETECT_DEFAULT_MODEL": "alpha",
                           "DETECT_IDLE_UNLOAD_S": "1"}, tmp_path / "log")
    try:
        assert server.request("POST", "/detect", RED, PNG)[0] == 200
        # On a slow machine the worker loaded at boot may already have idled out once before this
        # request reloaded it, so the counts are taken from here, not assumed to start at one.
        served = _models(server)["alpha"]
        unloaded = wait_for(lambda: (m := _models(server)["alpha"])["state"] == "unloaded" and m, 30,
                             "an idle unload", server.log_path)
        assert unloaded["pid"] is None and unloaded["memory"] is None
        assert wait_for(lambda: _gone(served["pid"]), 10, "the worker's exit")
        # every load so far ended in an idle unload, and nothing else unloaded it
        assert _metric(server, 'detect_model_unloads_total{model="alpha",reason="idle"}') == served["loads"]
        assert _metric(server, 'detect_model_loaded{model="alpha"}') == 0.0
        status, _, answer = server.request("POST", "/detect", RED, PNG)
        assert status == 200 and answer["timing_ms"]["load"] > 0
        assert [d["class_id"] for d in answer["detections"]] == [1]
        assert _models(server)["alpha"]["loads"] == served["loads"] + 1
    finally:
        assert server.stop() == 0


def test_models_take_turns_when_the_budget_holds_one_and_never_two_workers_live_at_once(repository, tmp_path):
    # 1 GiB caps plus 300 MiB overhead: one worker takes 1324 MiB of the 2000, two would take 2648.
    server = start_server({"DETECT_MODEL_REPOSITORY": str(repository), "DETECT_DEFAULT_MODEL": "alpha",
                           "DETECT_GPU_TOTAL_MIB": "2000", "DETECT_GPU_MEMORY": "1GiB",
                           "DETECT_GPU_OVERHEAD_MIB": "300"}, tmp_path / "log")
    alive: list[int] = []
    stop = threading.Event()

    def watch():  # every model worker the server has, as often as it can be asked
        while not stop.is_set():
            models = _models(server)
            alive.append(sum(1 for m in models.values() if m["pid"] is not None))

    watcher = threading.Thread(target=watch)
    try:
        assert [m["state"] for m in _models(server).values()] == ["ready", "unloaded"]  # beta did not fit at boot
        watcher.start()
        answers = [server.request("POST", f"/models/{name}/detect", RED, PNG) for name in ["beta", "alpha"] * 3]
        stop.set()
        watcher.join(30)
        assert [status for status, _, _ in answers] == [200] * 6
        assert [a["model"]["name"] for _, _, a in answers] == ["beta", "alpha"] * 3
        assert all("load" in a["timing_ms"] for _, _, a in answers)  # each waited for its turn
        assert alive and max(alive) == 1, alive
        assert _metric(server, 'detect_model_unloads_total{model="alpha",reason="evicted"}') == 3.0
        assert "unloading idle model alpha to make room on GPU 0" in server.log()
        # A load's own time, the eviction rule's break-even, leaves out its wait for room. With the wait in it,
        # each load here waited for the other model to be idle longer than the one before, until the sixth
        # request ran out of its deadline (504, in CI).
        ready = re.findall(r"model (\w+) version \d+ ready in ([\d.]+) s(?:, ([\d.]+) s of it waiting for room in "
                           r"the budget)?", server.log())
        assert any(waited for _, _, waited in ready), ready
        models = _models(server)
        for name in ("alpha", "beta"):
            total, waited = [(float(t), float(w or 0)) for n, t, w in ready if n == name][-1]
            assert abs(models[name]["last_load_s"] - (total - waited)) < 0.02, (name, total, waited, models[name])
    finally:
        stop.set()
        assert server.stop() == 0


def test_a_load_that_cannot_fit_beside_a_busy_model_is_refused_with_the_numbers(tmp_path, slow_blob_model_dir,
                                                                                blob_model_dir):
    root = _repository(tmp_path / "repo", slow_blob_model_dir, "busy")
    _repository(root, blob_model_dir / "2", "other")
    server = start_server({"DETECT_MODEL_REPOSITORY": str(root), "DETECT_DEFAULT_MODEL": "busy",
                           "DETECT_GPU_TOTAL_MIB": "2000", "DETECT_GPU_MEMORY": "1GiB",
                           "DETECT_GPU_OVERHEAD_MIB": "300"}, tmp_path / "log")
    try:
        busy = threading.Thread(target=lambda: server.request("POST", "/detect", RED, PNG))
        busy.start()
        wait_for(lambda: _models(server)["busy"]["in_flight"] == 1, 30, "a request in flight")
        status, headers, body = server.request("POST", "/models/other/detect", RED, PNG)
        busy.join(60)
        assert status == 503 and headers["Retry-After"] == "1"
        assert body["error"]["code"] == "insufficient_gpu_memory"
        assert "needs 1324 MiB on GPU 0" in body["error"]["message"]
        assert "676 MiB of the budget are left, held by busy/1" in body["error"]["message"]
        assert _models(server)["other"]["state"] == "unloaded"
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("budget", ["both fit", "one fits"])
def test_a_new_version_copied_in_under_load_takes_over_without_a_failed_request(tmp_path, blob_model_dir, budget):
    root = _repository(tmp_path / "repo", blob_model_dir / "2", "alpha")
    env = {"DETECT_MODEL_REPOSITORY": str(root), "DETECT_MODEL_POLL_S": "0.2"}
    if budget == "one fits":  # the old version must drain before the new one may start
        env.update({"DETECT_GPU_TOTAL_MIB": "2000", "DETECT_GPU_MEMORY": "1GiB", "DETECT_GPU_OVERHEAD_MIB": "300"})
    server = start_server(env, tmp_path / "log")
    try:
        old = _models(server)["alpha"]["pid"]
        with Load(server, "/detect") as load:
            wait_for(lambda: len(load.answers) > 20, 30, "answers from version 1")
            shutil.copytree(blob_model_dir / "2", root / "alpha" / "2")  # not atomic: the server waits for it to settle
            wait_for(lambda: any(v == "2" for _, v in load.answers[-5:]), 60, "answers from version 2", server.log_path)
            seen = len(load.answers)
            wait_for(lambda: len(load.answers) > seen + 20, 30, "more answers from version 2")
        assert load.failures() == []
        versions = [v for _, v in load.answers]
        switch = versions.index("2")
        assert set(versions[:switch]) == {"1"} and set(versions[switch + 8:]) == {"2"}  # a few in flight may straddle
        model = _models(server)["alpha"]
        assert model["version"] == "2" and model["pid"] != old
        # The old worker drains after the new one serves, then exits: on a busy machine, a moment later.
        wait_for(lambda: _gone(old), 30, "the old version's worker to exit", server.log_path)
        assert model["versions"] == [{"version": "1", "state": "unloaded"}, {"version": "2", "state": "ready"}]
        # Counted once stop() has returned, which a moment may separate from the exit itself.
        wait_for(lambda: _metric(server, 'detect_model_unloads_total{model="alpha",reason="replaced"}') == 1.0, 10,
                 "the replaced worker's unload to be counted", server.log_path)
        drained_first = "the old one drains first" in server.log()
        assert drained_first == (budget == "one fits")
    finally:
        assert server.stop() == 0


def test_a_corrupt_new_version_leaves_the_served_one_serving_and_is_reported_once(tmp_path, blob_model_dir):
    root = _repository(tmp_path / "repo", blob_model_dir / "2", "alpha")
    build_blob_model(root / "alpha" / "2")
    server = start_server({"DETECT_MODEL_REPOSITORY": str(root), "DETECT_MODEL_POLL_S": "0.2"}, tmp_path / "log")
    try:
        assert _models(server)["alpha"]["version"] == "2"
        broken = root / "alpha" / "3"
        broken.mkdir()
        (broken / "saved_model.pb").write_bytes(b"not a SavedModel")
        model = wait_for(lambda: (m := _models(server)["alpha"])["versions"][-1]["state"] == "failed" and m, 60,
                          "version 3 reported failed", server.log_path)
        assert model["state"] == "ready" and model["version"] == "2"
        assert "cannot be loaded as a SavedModel" in model["versions"][-1]["reason"]
        time.sleep(1.5)  # several polls: a version that failed is not tried again until its folder changes
        status, _, answer = server.request("POST", "/detect", RED, PNG)
        assert status == 200 and answer["model"]["version"] == "2"
        assert server.log().count("version 3 cannot be loaded") == 1
        assert _metric(server, 'detect_model_load_failures_total{model="alpha"}') == 1.0
    finally:
        assert server.stop() == 0


def test_tritonclient_indexes_loads_and_unloads_models(repository, tmp_path):
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    server = start_server({"DETECT_MODEL_REPOSITORY": str(repository), "DETECT_DEFAULT_MODEL": "alpha"},
                          tmp_path / "log")
    client = triton.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    try:
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert {n: (m["state"], m["version"]) for n, m in index.items()} == {"alpha": ("READY", "1"),
                                                                            "beta": ("READY", "1")}
        pid = _models(server)["beta"]["pid"]
        client.unload_model("beta")
        assert _gone(pid)
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["beta"]["state"] == "UNAVAILABLE" and "unloaded by request" in index["beta"]["reason"]
        status, headers, body = server.request("POST", "/models/beta/detect", RED, PNG)
        assert status == 503 and body["error"]["code"] == "model_unavailable" and headers["Retry-After"] == "1"
        client.load_model("beta")
        assert server.request("POST", "/models/beta/detect", RED, PNG)[0] == 200
        with pytest.raises(InferenceServerException, match="no model named 'gamma'"):
            client.load_model("gamma")
        assert _metric(server, 'detect_model_unloads_total{model="beta",reason="requested"}') == 1.0
    finally:
        client.close()
        assert server.stop() == 0


def test_a_worker_whose_server_is_killed_exits_and_gives_its_memory_back(repository, tmp_path):
    server = start_server({"DETECT_MODEL_REPOSITORY": str(repository), "DETECT_DEFAULT_MODEL": "alpha"},
                          tmp_path / "log")
    workers = [m["pid"] for m in _models(server).values()]
    server.process.kill()
    server.process.wait(10)
    assert wait_for(lambda: all(_gone(pid) for pid in workers), 15, "the workers' exit")


def test_a_spare_has_imported_tensorflow_and_a_policy_applied_afterwards_still_takes_effect():
    """What a spare does before it is given a model leaves TensorFlow's devices unconfigured.

    A GPU cap and this CPU split go through the same tf.config call, which fails once TensorFlow has
    initialized its devices; here it must succeed and show.
    """
    code = (
        "from app.models.worker import prepare\n"
        "prepare()\n"
        "import tensorflow as tf\n"
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "print(len(tf.config.list_logical_devices('CPU')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "2"


def test_a_crashed_worker_keeps_its_budget_for_its_restart_so_the_call_it_had_is_answered(
        tmp_path, slow_blob_model_dir, blob_model_dir):
    # The budget holds one worker. While `busy` restarts after a kill -9, a request for `other` must not take the
    # budget its successor needs: the call that was running on the killed worker runs again and is answered.
    root = _repository(tmp_path / "repo", slow_blob_model_dir, "busy")
    _repository(root, blob_model_dir / "2", "other")
    server = start_server({"DETECT_MODEL_REPOSITORY": str(root), "DETECT_DEFAULT_MODEL": "busy",
                           "DETECT_GPU_TOTAL_MIB": "2000", "DETECT_GPU_MEMORY": "1GiB",
                           "DETECT_GPU_OVERHEAD_MIB": "300", "DETECT_RESTART_BACKOFF_S": "1"}, tmp_path / "log")
    try:
        answers = []
        busy = threading.Thread(target=lambda: answers.append(server.request("POST", "/detect", RED, PNG)))
        busy.start()
        wait_for(lambda: _models(server)["busy"]["in_flight"] == 1, 30, "a request in flight")
        time.sleep(0.3)  # the call is on the worker
        os.kill(_models(server)["busy"]["pid"], signal.SIGKILL)
        wait_for(lambda: _models(server)["busy"]["pid"] is None, 10, "the kill seen")
        status, headers, body = server.request("POST", "/models/other/detect", RED, PNG)
        assert status == 503 and headers["Retry-After"] == "1", body
        assert body["error"]["code"] == "insufficient_gpu_memory" and "held by busy/1" in body["error"]["message"]
        busy.join(60)
        (status, _, answer), = answers
        assert status == 200 and [d["class_id"] for d in answer["detections"]] == [1], answer
        assert _models(server)["busy"]["state"] == "ready" and _models(server)["busy"]["pid"] is not None
    finally:
        assert server.stop() == 0


def test_a_corrupt_version_does_not_take_the_model_down_once_it_is_unloaded(tmp_path, blob_model_dir):
    # Version 2 is corrupt. Whether it lands while version 1 serves (the swap fails, 1 keeps serving) or while
    # the model is unloaded (its next load tries 2 first), requests are served by version 1 all along.
    root = _repository(tmp_path / "repo", blob_model_dir / "2", "alpha")
    server = start_server({"DETECT_MODEL_REPOSITORY": str(root), "DETECT_DEFAULT_MODEL": "alpha",
                           "DETECT_MODEL_POLL_S": "0.2", "DETECT_IDLE_UNLOAD_S": "1"}, tmp_path / "log")
    try:
        def corrupt(number: str) -> None:
            staging = root / f".staging-{number}"
            staging.mkdir()
            (staging / "saved_model.pb").write_bytes(b"not a SavedModel" * 10)
            staging.rename(root / "alpha" / number)

        assert server.request("POST", "/detect", RED, PNG)[0] == 200
        corrupt("2")  # while version 1 is loaded (or just idled out: either way it must not serve)
        wait_for(lambda: _models(server)["alpha"]["state"] == "unloaded" and "version 2" in server.log(), 30,
                 "the idle unload after the corrupt version was seen", server.log_path)
        status, _, answer = server.request("POST", "/detect", RED, PNG)
        assert status == 200 and answer["model"]["version"] == "1", answer
        wait_for(lambda: _models(server)["alpha"]["state"] == "unloaded", 30, "the next idle unload")
        corrupt("3")  # lands while unloaded: the next request tries 3, then falls back to 1
        status, _, answer = server.request("POST", "/detect", RED, PNG)
        assert status == 200 and answer["model"]["version"] == "1", answer
        versions = {v["version"]: v for v in _models(server)["alpha"]["versions"]}
        assert versions["3"]["state"] == "failed" and versions["1"]["state"] == "ready", versions
    finally:
        assert server.stop() == 0


def test_an_unload_by_request_under_traffic_drains_what_it_admitted_and_refuses_the_rest_at_once(
        tmp_path, repository):
    # Requests that arrive while the unload drains are refused at once (503, Retry-After) instead of waiting
    # for a model that is going away and holding the drain open until shutdown_grace_s.
    server = start_server({"DETECT_MODEL_REPOSITORY": str(repository), "DETECT_DEFAULT_MODEL": "alpha",
                           "DETECT_SHUTDOWN_GRACE_S": "20"}, tmp_path / "log")
    stop = threading.Event()
    answers: list[tuple[float, int, str, str]] = []

    def traffic():
        while not stop.is_set():
            status, headers, body = server.request("POST", "/detect", RED, PNG)
            code = body["error"]["code"] if status != 200 else ""
            answers.append((time.monotonic(), status, code, headers.get("Retry-After", "")))

    threads = [threading.Thread(target=traffic) for _ in range(12)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: len(answers) > 50, 60, "answers before the unload")
        started = time.monotonic()
        status, _, _ = server.request("POST", "/v2/repository/models/alpha/unload")
        unloaded = time.monotonic()
        assert status == 200 and unloaded - started < 5.0, unloaded - started
        assert _models(server)["alpha"]["state"] == "unloaded"
        wait_for(lambda: any(t > unloaded and s == 503 for t, s, _, _ in answers), 10, "refusals after it")
        assert server.request("POST", "/v2/repository/models/alpha/load")[0] == 200
        loaded = time.monotonic()
        wait_for(lambda: any(t > loaded and s == 200 for t, s, _, _ in answers), 30, "answers after the load")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        assert server.stop() == 0
    refused = {(code, retry) for _, status, code, retry in answers if status != 200}
    assert {status for _, status, _, _ in answers} == {200, 503}
    assert refused == {("model_unavailable", "1")}, refused


def test_a_load_by_request_with_a_corrupt_newest_version_answers_once_the_good_one_it_falls_back_to_is_ready(
        tmp_path, blob_model_dir):
    # The load tries version 2, which fails; the model falls back to version 1. The request waits for that
    # fallback and answers 200, rather than 400 for the attempt that failed.
    root = _repository(tmp_path / "repo", blob_model_dir / "2", "alpha")
    server = start_server({"DETECT_MODEL_REPOSITORY": str(root), "DETECT_DEFAULT_MODEL": "alpha"}, tmp_path / "log")
    try:
        assert server.request("POST", "/v2/repository/models/alpha/unload")[0] == 200
        (root / "alpha" / "2").mkdir()
        (root / "alpha" / "2" / "saved_model.pb").write_bytes(b"not a SavedModel" * 10)
        status, _, body = server.request("POST", "/v2/repository/models/alpha/load")
        assert status == 200, body
        versions = {v["version"]: v["state"] for v in _models(server)["alpha"]["versions"]}
        assert versions == {"1": "ready", "2": "failed"}, versions
        status, _, answer = server.request("POST", "/detect", RED, PNG)
        assert status == 200 and answer["model"]["version"] == "1", answer
    finally:
        assert server.stop() == 0


def test_an_unload_by_request_that_outlasts_a_load_says_so_and_leaves_the_model_serving(tmp_path, repository):
    # With no spare worker a load starts a process and imports TensorFlow (seconds); with a grace of 0 s an
    # unload cannot wait for it: it answers 503 and the model, once loaded, serves. (It used to answer 200 and
    # leave the model ready but refusing every request.)
    server = start_server({"DETECT_MODEL_REPOSITORY": str(repository), "DETECT_DEFAULT_MODEL": "alpha",
                           "DETECT_SPARE_WORKERS": "0", "DETECT_SHUTDOWN_GRACE_S": "0"}, tmp_path / "log")
    try:
        assert server.request("POST", "/v2/repository/models/alpha/unload")[0] == 200
        loads = []
        loader = threading.Thread(target=lambda: loads.append(server.request("POST", "/v2/repository/models/alpha/load")))
        loader.start()
        wait_for(lambda: _models(server)["alpha"]["state"] == "loading", 30, "the load under way")
        status, headers, body = server.request("POST", "/v2/repository/models/alpha/unload")
        loader.join(120)
        assert status == 503 and headers["Retry-After"] == "1" and "still loading" in body["error"], body
        assert [load[0] for load in loads] == [200], loads
        assert _models(server)["alpha"]["state"] == "ready" and not _models(server)["alpha"]["unloaded_by_request"]
        assert server.request("POST", "/detect", RED, PNG)[0] == 200
    finally:
        assert server.stop() == 0
