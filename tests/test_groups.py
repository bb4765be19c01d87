"""Worker groups on a real server (issue 43): two models in one worker process, each still a model of its own.

Each test builds a repository of blob detectors: `alpha` and `beta` name the worker group `pair`, and
`gamma` keeps a worker of its own. Real worker processes, real TensorFlow on the CPU; the GPU budget is
the stand-in of DETECT_GPU_TOTAL_MIB, as in tests/test_models.py.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from blob_model import blob_image
from conftest import start_server, wait_for
from images_for_tests import encode

RED = encode(blob_image(40, 30, {1: (4, 6, 20, 18)}))
BLUE = encode(blob_image(40, 30, {2: (10, 5, 30, 25)}))
PNG = {"Content-Type": "image/png"}
GROUP = """
[models.alpha]
worker_group = "pair"
[models.beta]
worker_group = "pair"
[groups.pair]
gpu_memory = "{cap}"
"""


def _repository(root: Path, source: Path, *names: str) -> Path:
    for name in names:
        shutil.copytree(source, root / name / "1")
    return root


def _serve(tmp_path, blob_model_dir, cap: str = "1GiB", **env) -> tuple:
    root = _repository(tmp_path / "repo", blob_model_dir / "2", "alpha", "beta", "gamma")
    config = tmp_path / "groups.toml"
    config.write_text(GROUP.format(cap=cap))
    server = start_server({"DETECT_MODEL_REPOSITORY": str(root), "DETECT_DEFAULT_MODEL": "gamma",
                           "DETECT_IDLE_UNLOAD_S": "0", **env}, tmp_path / "log", args=["--config", str(config)])
    return server, root


def _models(server) -> dict:
    return {m["name"]: m for m in server.request("GET", "/models")[2]["models"]}


def _children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _classes(answer: dict) -> list[int]:
    return [d["class_id"] for d in answer["detections"]]


def test_two_members_are_served_by_one_worker_each_answering_and_unloaded_one_at_a_time(tmp_path, blob_model_dir):
    server, _ = _serve(tmp_path, blob_model_dir, DETECT_SPARE_WORKERS="0")
    try:
        models = _models(server)
        alpha, beta, gamma = models["alpha"], models["beta"], models["gamma"]
        assert alpha["pid"] == beta["pid"] != gamma["pid"], models
        assert alpha["worker_group"] == beta["worker_group"] == "pair" and gamma["worker_group"] is None
        assert alpha["group_members"] == ["alpha", "beta"] and gamma["group_members"] == []
        assert _children(server.process.pid) == {alpha["pid"], gamma["pid"]}  # two workers for three models
        for name, image, classes in (("alpha", RED, [1]), ("beta", BLUE, [2]), ("gamma", RED, [1])):
            status, _, answer = server.request("POST", f"/models/{name}/detect", image, PNG)
            assert status == 200 and _classes(answer) == classes and answer["model"]["name"] == name, answer
        group_pid = alpha["pid"]
        _shows_the_group(server, group_pid)

        assert server.request("POST", "/v2/repository/models/alpha/unload")[0] == 200
        status, _, answer = server.request("POST", "/models/beta/detect", BLUE, PNG)
        assert status == 200 and _classes(answer) == [2]
        models = _models(server)
        assert models["alpha"]["state"] == "unloaded" and models["beta"]["pid"] == group_pid
        assert os.path.exists(f"/proc/{group_pid}")
        wait_for(lambda: "unloaded from this worker" in server.log(), 30, "the member released in the worker",
                 server.log_path)

        assert server.request("POST", "/v2/repository/models/beta/unload")[0] == 200
        wait_for(lambda: not os.path.exists(f"/proc/{group_pid}"), 30, "the group's worker gone with its last member")
        assert _children(server.process.pid) == {gamma["pid"]}

        assert server.request("POST", "/v2/repository/models/beta/load")[0] == 200  # a fresh worker for the group
        assert server.request("POST", "/v2/repository/models/alpha/load")[0] == 200
        models = _models(server)
        assert models["alpha"]["pid"] == models["beta"]["pid"] not in (group_pid, None)
    finally:
        assert server.stop() == 0


def _shows_the_group(server, pid: int) -> None:
    """/gpu lists the group with its members, its one pid and one overhead; the metrics and the history name it."""
    (group,) = server.request("GET", "/gpu")[2]["groups"]
    assert group["name"] == "pair" and group["members"] == group["loaded"] == ["alpha", "beta"], group
    assert group["pid"] == pid and group["overhead_mib"] == 1024
    config = server.request("GET", "/v2/models/alpha/config")[2]  # Triton's model configuration
    assert config["instance_group"][0]["name"] == "pair"
    assert config["parameters"] == {"worker_group": {"string_value": "pair"}}
    assert "parameters" not in server.request("GET", "/v2/models/gamma/config")[2]
    metrics = server.request("GET", "/metrics")[2].decode()
    for name in ("alpha", "beta"):
        assert f'detect_model_worker_group_info{{group="pair",model="{name}",pid="{pid}"}} 1.0' in metrics
    assert "detect_model_worker_group_info{" + 'group="",model="gamma"' not in metrics

    def series() -> dict:
        return {(s["kind"], s["name"]): s for s in server.request("GET", "/gpu/history")[2]["series"]}

    def sampled() -> bool:
        found = series().get(("group", "pair"))
        return found is not None and found["samples"][-1][3] == "alpha, beta loaded" and found["samples"][-1][1] > 0

    wait_for(sampled, 10, "the group's memory series, both loaded")
    kinds = series()
    assert ("model", "alpha") not in kinds and ("model", "gamma") in kinds  # the group's memory is not split


class Traffic:
    """`connections` keep-alive connections sending to the named models in turn; every answer kept by model."""

    def __init__(self, port: int, names: list[str], connections: int):
        self.port = port
        self.names = names
        self.answers: list[tuple[str, object]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(i,), daemon=True) for i in range(connections)]

    def _send(self, index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=90)
        turn = index
        while not self._stop.is_set():
            name = self.names[turn % len(self.names)]
            turn += 1
            try:
                conn.request("POST", f"/models/{name}/detect", body=RED, headers=PNG)
                response = conn.getresponse()
                response.read()
                answer = (name, response.status)
            except (OSError, http.client.HTTPException) as exc:
                answer = (name, type(exc).__name__)
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=90)
            self.answers.append(answer)
        conn.close()

    def __enter__(self) -> "Traffic":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def outcomes(self, name: str) -> Counter:
        return Counter(status for model, status in list(self.answers) if model == name)


def test_a_kill_of_the_groups_worker_under_32_connections_brings_every_member_back_and_fails_no_other_group(
        tmp_path, blob_model_dir):
    server, _ = _serve(tmp_path, blob_model_dir, DETECT_RESTART_BACKOFF_S="0.5")
    try:
        group_pid = _models(server)["alpha"]["pid"]
        with Traffic(server.port, ["alpha", "beta", "gamma"], 32) as traffic:
            wait_for(lambda: len(traffic.answers) > 60, 120, "traffic under way")
            os.kill(group_pid, signal.SIGKILL)
            wait_for(lambda: _models(server)["alpha"]["pid"] not in (None, group_pid)
                     and _models(server)["beta"]["pid"] not in (None, group_pid), 120,
                     "both members back", server.log_path)
            seen = len(traffic.answers)
            wait_for(lambda: len(traffic.answers) > seen + 60, 120, "traffic after the restart")
        models = _models(server)
        assert models["alpha"]["pid"] == models["beta"]["pid"], models  # back in one worker together
        assert models["alpha"]["state"] == models["beta"]["state"] == "ready"
        assert set(traffic.outcomes("gamma")) == {200}, traffic.outcomes("gamma")  # the other group never fails
        for name in ("alpha", "beta"):
            assert set(traffic.outcomes(name)) == {200}, (name, traffic.outcomes(name))  # calls ran again
        assert f"its group pair's worker {group_pid} " in server.log()  # each member's reason names it
    finally:
        assert server.stop() == 0


def test_a_new_version_of_one_member_loads_into_the_same_worker_without_failing_the_other(tmp_path, blob_model_dir):
    server, root = _serve(tmp_path, blob_model_dir, DETECT_MODEL_POLL_S="0.2")
    try:
        group_pid = _models(server)["beta"]["pid"]
        with Traffic(server.port, ["beta"], 8) as traffic:
            wait_for(lambda: len(traffic.answers) > 20, 60, "traffic under way")
            staging = root / ".staging"
            shutil.copytree(blob_model_dir / "2", staging)
            staging.rename(root / "alpha" / "2")
            wait_for(lambda: _models(server)["alpha"]["version"] == "2"
                     and "unloaded from this worker" in server.log(), 120, "alpha's version 2 served", server.log_path)
            seen = len(traffic.answers)
            wait_for(lambda: len(traffic.answers) > seen + 10, 60, "traffic after the swap")
        assert set(traffic.outcomes("beta")) == {200}, traffic.outcomes("beta")
        models = _models(server)
        assert models["alpha"]["pid"] == models["beta"]["pid"] == group_pid  # the same worker all along
        status, _, answer = server.request("POST", "/models/alpha/detect", RED, PNG)
        assert status == 200 and answer["model"]["version"] == "2"
    finally:
        assert server.stop() == 0


def test_a_group_costs_its_cap_and_one_overhead_in_the_budget(tmp_path, blob_model_dir):
    # 2700 MiB holds the group (1024 + 300) and gamma (1024 + 300): 2648. With an overhead per member it would
    # need 3972, and a model of the group would not be preloaded.
    server, _ = _serve(tmp_path, blob_model_dir, DETECT_GPU_TOTAL_MIB="2700", DETECT_GPU_MEMORY="1GiB",
                       DETECT_GPU_OVERHEAD_MIB="300")
    try:
        models = _models(server)
        assert {m["state"] for m in models.values()} == {"ready"}, models
        assert models["alpha"]["caps_mib"] == models["beta"]["caps_mib"] == {"0": 1024}
        assert "not preloaded" not in server.log()
    finally:
        assert server.stop() == 0


def test_a_group_that_cannot_fit_gets_503_insufficient_gpu_memory_naming_the_group(tmp_path, blob_model_dir):
    server, _ = _serve(tmp_path, blob_model_dir, cap="2GiB", DETECT_GPU_TOTAL_MIB="2000",
                       DETECT_GPU_MEMORY="1GiB", DETECT_GPU_OVERHEAD_MIB="300", DETECT_PRELOAD="false")
    try:
        status, headers, body = server.request("POST", "/models/alpha/detect", RED, PNG)
        assert status == 503 and body["error"]["code"] == "insufficient_gpu_memory", body
        assert "worker group pair" in body["error"]["message"] and "2348 MiB" in body["error"]["message"]
        assert server.request("POST", "/models/gamma/detect", RED, PNG)[0] == 200  # a model of its own still fits
    finally:
        assert server.stop() == 0


def test_a_load_while_the_groups_worker_is_on_its_way_out_waits_for_its_budget_and_evicts_nothing(
        tmp_path, blob_model_dir):
    # 2700 MiB holds the group (1024 + 300) and gamma (1024 + 300). When the group's last member unloads, its
    # worker stops; a member loaded meanwhile must wait for that worker's exit, which gives its budget back,
    # not find the budget short and evict gamma to make room, or be refused.
    server, _ = _serve(tmp_path, blob_model_dir, DETECT_GPU_TOTAL_MIB="2700", DETECT_GPU_MEMORY="1GiB",
                       DETECT_GPU_OVERHEAD_MIB="300")
    try:
        gamma_pid = _models(server)["gamma"]["pid"]
        assert server.request("POST", "/v2/repository/models/alpha/unload")[0] == 200
        for attempt in range(3):
            old_pid = _models(server)["beta"]["pid"]
            answers = {}
            unload = threading.Thread(target=lambda: answers.setdefault(
                "unload", server.request("POST", "/v2/repository/models/beta/unload")))
            unload.start()
            wait_for(lambda: _models(server)["beta"]["state"] != "ready", 10, "beta's unload under way")
            answers["load"] = server.request("POST", "/v2/repository/models/alpha/load")
            unload.join(30)
            assert answers["unload"][0] == 200 and answers["load"][0] == 200, answers
            models = _models(server)
            assert models["alpha"]["state"] == "ready" and models["alpha"]["pid"] not in (old_pid, None), models
            assert models["gamma"]["state"] == "ready" and models["gamma"]["pid"] == gamma_pid, models
            assert "unloading idle model gamma" not in server.log()
            # Swap roles for the next round: beta joins alpha's new worker, then alpha leaves it.
            assert server.request("POST", "/v2/repository/models/beta/load")[0] == 200
            assert server.request("POST", "/v2/repository/models/alpha/unload")[0] == 200
    finally:
        assert server.stop() == 0


def test_an_idle_member_beside_a_busy_one_is_not_evicted_for_nothing(tmp_path, blob_model_dir, slow_blob_model_dir):
    # The group (alpha idle, beta busy) and gamma fill 2648 of 2700 MiB; delta needs 1324. alpha has been idle
    # longest, but unloading it would free nothing while beta keeps their worker: gamma must make the room.
    root = _repository(tmp_path / "repo", blob_model_dir / "2", "alpha", "gamma", "delta")
    _repository(root, slow_blob_model_dir, "beta")
    config = tmp_path / "groups.toml"
    # beta takes one image per call, one call at a time: with three clients, two always wait their turn.
    config.write_text(GROUP.format(cap="1GiB").replace('[models.beta]\n', '[models.beta]\nmax_batch_size = 1\n'
                                                      'inference_threads = 1\n'))
    server = start_server({"DETECT_MODEL_REPOSITORY": str(root), "DETECT_DEFAULT_MODEL": "gamma",
                           "DETECT_IDLE_UNLOAD_S": "0", "DETECT_PRELOAD": "false", "DETECT_GPU_TOTAL_MIB": "2700",
                           "DETECT_GPU_MEMORY": "1GiB", "DETECT_GPU_OVERHEAD_MIB": "300"},
                          tmp_path / "log", args=["--config", str(config)])
    stop = threading.Event()

    def keep_beta_busy():
        while not stop.is_set():
            server.request("POST", "/models/beta/detect", BLUE, PNG)

    busy = [threading.Thread(target=keep_beta_busy) for _ in range(3)]
    try:
        for name in ("alpha", "beta", "gamma"):
            assert server.request("POST", f"/v2/repository/models/{name}/load")[0] == 200
        models = _models(server)
        assert models["alpha"]["pid"] == models["beta"]["pid"] != models["gamma"]["pid"], models
        for thread in busy:
            thread.start()
        wait_for(lambda: _models(server)["beta"]["in_flight"] >= 2, 30, "beta busy")
        assert server.request("POST", "/models/gamma/detect", RED, PNG)[0] == 200  # alpha is idle longest
        time.sleep(max(m["last_load_s"] for m in _models(server).values() if m["last_load_s"]) + 0.5)

        status, _, answer = server.request("POST", "/models/delta/detect", RED, PNG)
        assert status == 200 and answer["model"]["name"] == "delta", answer
        models = _models(server)
        assert models["gamma"]["state"] == "unloaded" and "unloading idle model gamma" in server.log()
        assert models["alpha"]["state"] == "ready" and models["alpha"]["pid"] == models["beta"]["pid"], models
        assert "unloading idle model alpha" not in server.log()
    finally:
        stop.set()
        for thread in busy:
            thread.join(60)
        assert server.stop() == 0
