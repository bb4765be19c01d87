"""A quiet log on the CPU: TensorFlow's native start-up notices ("Could not find cuda drivers", oneDNN, absl's
not-initialized notice, grappler's "Error in PredictCost()") stay out of the server's log unless the user asks for
them with TF_CPP_MIN_LOG_LEVEL; TensorFlow's warnings and errors still come through."""

from __future__ import annotations

import os

from conftest import start_server
from images_for_tests import encode
from test_http import RED_GREEN

from app.process import is_load_notice, quiet_tensorflow_startup, tensorflow_load_notices_dropped

NOISE = ("Could not find cuda drivers", "oneDNN custom operations", "absl::InitializeLog", "PredictCost",
         "cpu_feature_guard", "This TensorFlow binary is optimized")

INFO = b"I0000 00:00:1796563515.197510   20385 cudart_stub.cc:31] Could not find cuda drivers on your machine.\n"
NOTICE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
WARNING = b"W0000 00:00:1796563483.901887   19935 op_level_cost_estimator.cc:699] Error in PredictCost() for the op\n"
ERROR = b"E0000 00:00:1796563481.437440   19933 cuda_platform.cc:52] failed call to cuInit: CUDA error\n"


def test_a_cpu_server_and_its_workers_log_no_tensorflow_start_up_notices(blob_model_dir, tmp_path):
    """A real server, its spare and its model worker, started as a user would: no TF_CPP_MIN_LOG_LEVEL set."""
    server = start_server({"DETECT_MODEL": str(blob_model_dir), "TF_CPP_MIN_LOG_LEVEL": None}, tmp_path / "serve.log")
    try:
        status, _, answer = server.request("POST", "/detect", encode(RED_GREEN), {"Content-Type": "image/png"})
        assert status == 200 and answer["detections"]
    finally:
        assert server.stop() == 0
    log = server.log()
    assert "loaded and warmed" in log and "ready" in log  # the worker did start, import and warm up
    noisy = [line for line in log.splitlines() if any(word in line for word in NOISE) or is_load_notice(line.encode())]
    assert noisy == [], "\n".join(noisy)


def test_only_tensorflows_info_notices_are_dropped_its_warnings_and_errors_are_kept(capfd):
    assert is_load_notice(INFO) and is_load_notice(NOTICE)
    assert not any(is_load_notice(line) for line in (WARNING, ERROR, b"Traceback (most recent call last):\n"))
    with tensorflow_load_notices_dropped({"TF_CPP_MIN_LOG_LEVEL": "2"}):
        for line in (NOTICE, INFO, ERROR, b"a line of the worker's own\n", WARNING):
            os.write(2, line)
    assert capfd.readouterr().err.encode() == ERROR + b"a line of the worker's own\n" + WARNING


def test_a_level_the_user_sets_is_kept_and_0_shows_every_notice(capfd):
    environ = {"TF_CPP_MIN_LOG_LEVEL": "0"}
    quiet_tensorflow_startup(environ)
    assert environ == {"TF_CPP_MIN_LOG_LEVEL": "0"}
    with tensorflow_load_notices_dropped(environ):
        os.write(2, NOTICE + INFO)
    assert capfd.readouterr().err.encode() == NOTICE + INFO
    unset: dict = {}
    quiet_tensorflow_startup(unset)
    assert unset == {"TF_CPP_MIN_LOG_LEVEL": "2"}  # INFO and WARNING off; errors still shown
