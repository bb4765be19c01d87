"""Smoke runs of the load tools (scripts/bench, overload, soak) against real servers.

They pin down that each tool runs end to end, writes its files and reports sane numbers, and
that under overload the service answers only 200 or 503 with no connection failures. They never
assert how fast anything is: the machine is shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FACES = ROOT / "models" / "faces"


def run_tool(name: str, *args: str, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Run `python -m tools.<name>` with this interpreter; return the finished process (output captured)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return subprocess.run([sys.executable, "-m", f"tools.{name}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_bench_smoke_writes_json_and_plot_with_error_free_steps(blob_model_dir, tmp_path):
    """With --v2, --compare-decode and --image-size, as the KServe and photo-sized rows of docs/measured.md are measured."""
    pytest.importorskip("matplotlib", reason="the bench plot needs matplotlib (scripts/bench installs it)")
    out = tmp_path / "bench"
    done = run_tool("bench", "--smoke", "--v2", "--model", str(blob_model_dir), "--out", str(out),
                    "--compare-decode", "--image-size", "800x600")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "smoke checks passed" in done.stderr
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")
    result = json.loads((out / "bench.json").read_text())
    assert result["ceiling"]["images_per_s"] > 0
    assert result["ceiling"]["single_image_ms_p50"] > 0
    assert result["images"]["size"] == "800x600" and result["images"]["count"] == 16
    assert set(result["modes"]) == {"batching", "full_size_decode", "v2_binary"}  # /detect twice, KServe v2
    assert result["modes"]["full_size_decode"]["settings"]["decode_at_model_size"] is False
    for mode in result["modes"].values():
        steps = mode["steps"]
        assert [s["connections"] for s in steps] == [1, 4]
        for step in steps:
            assert set(step["statuses"]) == {"200"} and step["connection_errors"] == 0
            assert step["images_per_s"] > 0 and step["rss_mb"] > 0
            assert 0 < step["latency_ms"]["p50"] <= step["latency_ms"]["p99"]
    assert [row["connections"] for row in result["decode_comparison"]] == [1, 4]
    assert all(row["speedup"] > 0 for row in result["decode_comparison"])
    assert result["machine"]["load_average_start"]


def test_ab_drives_two_checkouts_in_turn_and_counts_each_ones_process_tree(blob_model_dir, tmp_path):
    out = tmp_path / "ab.json"
    done = run_tool("ab", "--a", str(ROOT), "--b", str(ROOT), "--model", str(blob_model_dir), "--connections", "2",
                    "--pairs", "2", "--duration", "1", "--out", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    (pairs,) = [step["pairs"] for step in result["steps"].values()]
    assert [p["order"] for p in pairs] == ["ab", "ba"]  # ABBA: neither checkout always goes first
    for pair in pairs:
        for side in ("a", "b"):
            assert pair[side]["errors"] == 0 and pair[side]["images_per_s"] > 0 and pair[side]["p50_ms"] > 0
            assert pair[side]["cpu_ms_per_image"] > 0  # the HTTP process and its worker, from /proc
        assert pair["b_over_a"] == round(pair["b"]["images_per_s"] / pair["a"]["images_per_s"], 3)
    assert "b/a median" in done.stdout


def test_overload_answers_only_200_or_503_without_connection_failures(tmp_path):
    """On the faces model inference is the bottleneck, so 4x load really fills the queue.

    --max-queue skips the sizing server, to keep the test short.
    """
    out = tmp_path / "overload"
    done = run_tool("overload", "--model", str(FACES), "--duration", "8", "--probe-duration", "3",
                    "--max-queue", "4", "--out", str(out))
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: a latency check failed; not asserted here
    assert "verdict:" in done.stderr
    result = json.loads((out / "overload.json").read_text())
    statuses = result["overload"]["statuses"]
    assert set(statuses) <= {"200", "503"}, statuses
    assert statuses.get("503", 0) > 0, "4x load never filled the queue"
    assert statuses.get("200", 0) > 0
    assert result["overload"]["error_total"] == 0, result["overload"]["errors"]
    assert result["overload"]["retry_after_missing"] == 0
    checks = {c["check"]: c["passed"] for c in result["checks"]}
    assert checks["only 200 or 503 under overload"]
    assert checks["no connection resets or other connection failures"]
    assert result["server_exit"] == 0


def test_soak_smoke_keeps_memory_threads_and_descriptors_steady(blob_model_dir, tmp_path):
    out = tmp_path / "soak"
    done = run_tool("soak", "--smoke", "--model", str(blob_model_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "soak.json").read_text())
    assert sum(result["statuses"].values()) == result["requests"] + result["warmup_requests"]
    assert set(result["statuses"]) == {"200"}
    assert result["rss_growth_mb"] < 50
    assert len(result["threads_seen"]) == 1 and len(result["fds_seen"]) == 1


@pytest.mark.parametrize("args, message", [
    (["--connections", "0"], "connections must be"),
    (["--duration", "0"], "duration must be"),
    (["--requests", "0"], "requests must be"),
])
def test_loadgen_refuses_unbounded_or_empty_plans(tmp_path, args, message):
    (tmp_path / "one.jpg").write_bytes(b"\xff\xd8\xff")
    done = subprocess.run([sys.executable, "-m", "tools.loadgen", "--port", "1", "--images", str(tmp_path), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


def test_loadgen_wraps_an_image_as_the_peers_take_it():
    """KServe v1 (instances, b64) and v2 JSON (a base64 BYTES input, as MLServer's Base64Codec reads it)."""
    import base64

    from tools import loadgen

    image = b"\xff\xd8\xff\xe0 not UTF-8 \xff\xd9"
    v1 = json.loads(loadgen.v1_request(image))
    assert base64.b64decode(v1["instances"][0]["image"]["b64"]) == image
    (v2,) = json.loads(loadgen.v2_json_request(image))["inputs"]
    assert v2["datatype"] == "BYTES" and v2["shape"] == [1] and v2["parameters"] == {"content_type": "base64"}
    assert base64.b64decode(v2["data"][0]) == image


@pytest.mark.parametrize("flag, path", [("--v1-model", "/v1/models/m:predict"), ("--v2-json-model", "/v2/models/m/infer"),
                                        ("--path", "/m")])
def test_loadgen_posts_each_request_format_to_its_route(tmp_path, flag, path):
    """One closed-loop request against a local HTTP server that records the request line and content type."""
    import http.server
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, self.headers["Content-Type"]))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "one.jpg").write_bytes(b"\xff\xd8\xff")
        value = "m" if flag != "--path" else "/m"
        done = subprocess.run([sys.executable, "-m", "tools.loadgen", "--port", str(server.server_address[1]),
                               "--images", str(tmp_path), "--requests", "1", flag, value], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["statuses"] == {"200": 1}
    assert seen == [(path, "image/jpeg" if flag == "--path" else "application/json")]


def test_surfaces_makes_each_attack_and_reports_what_the_probes_answered(tmp_path):
    """tools/surfaces.py runs every attack against a real server and writes what each got; the figures of
    docs/measured.md#surfaces come from it. The behaviour itself is asserted in tests/protocol/."""
    out = tmp_path / "surfaces"
    done = run_tool("surfaces", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "surfaces.json").read_text())
    for attack in ("idle watches", "idle reflection"):
        assert {name: answer["code"] for name, answer in result[attack]["meanwhile"].items()} == dict.fromkeys(
            ("liveness", "ServerLive", "ModelInfer"), "OK"), result[attack]
    assert result["a 256 MiB region, 12 requests"]["statuses"] == [413] * 12
    assert result["timeout 10**310"]["status"] == 400
