"""A load generator for the service: HTTP/1.1 keep-alive connections over asyncio streams, 127.0.0.1 only.

N connections each send one request, read the whole answer, and send the next (closed loop), until
the duration or the request count is reached; the requests in flight then finish (up to the request
timeout). With `--rate`, the connections take send times from one shared schedule of slots, evenly
spaced or, with `--arrivals poisson`, at exponential gaps (seeded) as from many independent
clients; the offered load is the rate as long as a connection is free at each slot (a late send is
counted, never dropped). Each image is POSTed as a raw `image/jpeg` (or png) body (to `--path`); with
`--v2-model`, as a KServe v2 binary request; with `--v2-json-model`, as a v2 JSON request, the file base64 in
a BYTES input (MLServer's way); with `--v1-model`, as a KServe v1 `instances` request with the file base64; with `--grpc-model`, as a KServe v2 gRPC ModelInfer call (the same BYTES input
`image` and output `detections`), one gRPC channel (HTTP/2 connection) per connection, OK counted as 200,
RESOURCE_EXHAUSTED and UNAVAILABLE as 503, DEADLINE_EXCEEDED as 504, anything else as 500.

It reports counts per status, connection failures by kind (refused, reset, closed before a whole
answer, timeout, protocol), latency percentiles, throughput and its own CPU time; with `--records`,
every request as [send time since start (s), latency (ms), status or 0].

Run as `python -m tools.loadgen --port P --images DIR ...` (JSON on stdout or `--out`),
or from another tool with `spawn` and `collect`, so the load runs in a process of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tools import ROOT

HOST = "127.0.0.1"  # never anywhere else: this tool is for a local server
MAX_CONNECTIONS = 1024
MAX_DURATION_S = 3600.0
MAX_REQUESTS = 1_000_000
CONTENT_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png"}
ERROR_KINDS = ("refused", "connect", "reset", "eof", "timeout", "protocol")


@dataclass(frozen=True)
class LoadPlan:
    """What to send, how hard, and for how long; every bound is checked by `check`."""

    port: int
    bodies: tuple[tuple[bytes, str], ...]  # (body, content type), sent in turn
    connections: int = 1
    duration_s: float = 10.0  # stop starting requests after this (s)
    requests: int = MAX_REQUESTS  # stop starting requests after this many
    rate: Optional[float] = None  # requests/s over all connections; None: as fast as answers come
    arrivals: str = "uniform"  # with a rate: "uniform" gaps of 1/rate, or "poisson" (exponential gaps)
    seed: int = 0  # for poisson gaps
    timeout_s: float = 60.0  # one request, send to last byte (s)
    start_delay_s: float = 0.0  # wait this long before the first request (s)
    path: str = "/detect"
    # With KServe v2 binary bodies: each body's JSON header length, sent as Inference-Header-Content-Length.
    header_lengths: tuple[int, ...] = ()
    grpc: bool = False  # the bodies are serialized ModelInferRequests, sent to the gRPC port `port`

    def check(self) -> None:
        """Raise ValueError if a bound is out of range."""
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not a TCP port")
        if not self.bodies:
            raise ValueError("no request bodies: give at least one image")
        if not 1 <= self.connections <= MAX_CONNECTIONS:
            raise ValueError(f"connections must be 1 to {MAX_CONNECTIONS}, not {self.connections}")
        if not 0 < self.duration_s <= MAX_DURATION_S:
            raise ValueError(f"duration must be above 0 and at most {MAX_DURATION_S:g} s")
        if not 1 <= self.requests <= MAX_REQUESTS:
            raise ValueError(f"requests must be 1 to {MAX_REQUESTS}")
        if self.rate is not None and not 0 < self.rate <= 100_000:
            raise ValueError("rate must be above 0 and at most 100000 requests/s")
        if self.arrivals not in ("uniform", "poisson"):
            raise ValueError("arrivals must be uniform or poisson")
        if not 0 < self.timeout_s <= 600 or not 0 <= self.start_delay_s <= MAX_DURATION_S:
            raise ValueError("timeout must be in (0, 600] s and the start delay in [0, 3600] s")
        if not self.path.startswith("/"):
            raise ValueError("path must start with /")


@dataclass
class _Tally:
    """Everything the workers record; touched only from the event loop's thread."""

    records: list = field(default_factory=list)  # (sent since start s, latency s, status or 0)
    statuses: dict = field(default_factory=dict)
    errors: dict = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))
    error_examples: list = field(default_factory=list)
    retry_after_missing: int = 0  # 503s without a Retry-After header
    connects: int = 0
    server_closes: int = 0  # answers with Connection: close
    late_sends: int = 0  # paced sends more than 10 ms behind their slot
    max_lateness_s: float = 0.0
    started: int = 0
    in_flight: int = 0
    first_sent: Optional[float] = None
    last_done: Optional[float] = None
    stopped_sending: Optional[float] = None


class _ProtocolError(Exception):
    """The server's answer is not HTTP/1.1 as we read it."""


class _Connection:
    """One keep-alive connection; reconnects after the server closes it or a failure."""

    def __init__(self, port: int):
        self.port = port
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(HOST, self.port, limit=2**20)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()  # no lingering FIN handshake to wait for
        self.reader = self.writer = None

    async def exchange(self, head: bytes, body: bytes) -> tuple[int, dict]:
        """Send one request and read its whole answer; return (status, lower-cased headers)."""
        self.writer.write(head)
        self.writer.write(body)
        await self.writer.drain()
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise _ProtocolError(f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            await self._read_chunked()
        elif "content-length" in headers:
            await self.reader.readexactly(int(headers["content-length"]))
        elif status not in (204, 304):
            await self.reader.read()  # no length: the body ends with the connection
            headers["connection"] = "close"
        return status, headers

    async def _read_chunked(self) -> None:
        while True:
            line = await self.reader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0].strip() or b"x", 16)
            if size == 0:
                while (await self.reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers
                return
            await self.reader.readexactly(size + 2)


GRPC_AS_HTTP = {"OK": 200, "RESOURCE_EXHAUSTED": 503, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
                "INVALID_ARGUMENT": 400, "NOT_FOUND": 404}
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


class _GrpcConnection:
    """One gRPC channel (one HTTP/2 connection) calling ModelInfer with pre-serialized requests."""

    def __init__(self, port: int):
        self.port = port
        self.writer = None  # the channel, once open (named as _Connection's, which _one checks)
        self._call = None

    async def open(self) -> None:
        import grpc

        self.writer = grpc.aio.insecure_channel(f"{HOST}:{self.port}")
        self._call = self.writer.unary_unary(MODEL_INFER)  # bytes in, bytes out: no parsing on this side

    def close(self) -> None:
        if self.writer is not None:
            asyncio.ensure_future(self.writer.close())
        self.writer = self._call = None

    async def exchange(self, head: bytes, body: bytes) -> tuple[int, dict]:
        import grpc

        try:
            await self._call(body)
            return 200, {"grpc-status": "OK"}
        except grpc.aio.AioRpcError as exc:
            return GRPC_AS_HTTP.get(exc.code().name, 500), {"grpc-status": exc.code().name}


def grpc_infer_request(model: str, image: bytes) -> bytes:
    """One image file as a serialized KServe v2 ModelInferRequest: the BYTES input `image` (a 4-byte
    little-endian length, then the file) and the output `detections`, as v2_binary_request sends it over HTTP."""
    from app.grpc.protos import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(
        model_name=model, inputs=[pb.ModelInferRequest.InferInputTensor(name="image", datatype="BYTES", shape=[1])],
        outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="detections")],
        raw_input_contents=[len(image).to_bytes(4, "little") + image])
    return request.SerializeToString()


def _request_heads(plan: LoadPlan) -> list[bytes]:
    if plan.grpc:
        return [b""] * len(plan.bodies)
    lengths = plan.header_lengths or (None,) * len(plan.bodies)
    return [
        (f"POST {plan.path} HTTP/1.1\r\nHost: {HOST}:{plan.port}\r\nContent-Type: {kind}\r\n"
         + ("" if length is None else f"Inference-Header-Content-Length: {length}\r\n")
         + f"Content-Length: {len(body)}\r\nUser-Agent: loadgen\r\n\r\n").encode("latin-1")
        for (body, kind), length in zip(plan.bodies, lengths)
    ]


def v2_binary_request(image: bytes) -> tuple[bytes, int]:
    """Wrap one image file as a KServe v2 request with Triton's binary extension, as tritonclient sends it:
    the BYTES input `image` (a 4-byte little-endian length, then the file), asking for `detections` in binary.
    Return the body and its JSON header's length."""
    element = len(image).to_bytes(4, "little") + image
    header = json.dumps({
        "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(element)}}],
        "outputs": [{"name": "detections", "parameters": {"binary_data": True}}],
    }).encode()
    return header + element, len(header)


def v2_json_request(image: bytes) -> bytes:
    """Wrap one image file as a v2 JSON request: the BYTES input `image`, the file in base64, marked so
    (`content_type: base64`, MLServer's Base64Codec)."""
    return json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                   "parameters": {"content_type": "base64"},
                                   "data": [base64.b64encode(image).decode("ascii")]}]}).encode()


def v1_request(image: bytes) -> bytes:
    """Wrap one image file as a KServe v1 predict request: one instance, the file under `image` as `{"b64"}`."""
    return json.dumps({"instances": [{"image": {"b64": base64.b64encode(image).decode("ascii")}}]}).encode()


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return "reset"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "eof"
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, (_ProtocolError, ValueError, asyncio.LimitOverrunError)):
        return "protocol"
    return "connect" if isinstance(exc, OSError) else "protocol"


async def _run(plan: LoadPlan, progress: Optional[str]) -> dict:
    plan.check()
    tally = _Tally()
    heads = _request_heads(plan)
    if plan.start_delay_s:
        await asyncio.sleep(plan.start_delay_s)
    clock = time.perf_counter
    started_wall = time.time()
    t0 = clock()
    end = t0 + plan.duration_s
    interval = 1.0 / plan.rate if plan.rate else 0.0
    gaps = random.Random(plan.seed)
    schedule = {"next": t0}

    def next_send() -> Optional[tuple[int, float]]:
        """Claim the next request; return its number and slot time (t0 when unpaced), or None to stop."""
        k = tally.started
        slot = schedule["next"]
        if k >= plan.requests or slot >= end or clock() >= end:
            return None
        tally.started += 1
        if interval:
            schedule["next"] += gaps.expovariate(plan.rate) if plan.arrivals == "poisson" else interval
        return k, slot

    async def worker() -> None:
        conn = _GrpcConnection(plan.port) if plan.grpc else _Connection(plan.port)
        try:
            while True:
                claimed = next_send()
                if claimed is None:
                    return
                k, slot = claimed
                if interval:
                    delay = slot - clock()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    elif -delay > 0.010:
                        tally.late_sends += 1
                        tally.max_lateness_s = max(tally.max_lateness_s, -delay)
                index = k % len(heads)
                await _one(conn, heads[index], plan.bodies[index][0])
        finally:
            conn.close()

    async def _one(conn: _Connection, head: bytes, body: bytes) -> None:
        sent = clock()
        if tally.first_sent is None:
            tally.first_sent = sent
        tally.in_flight += 1
        status, kind = 0, None
        try:
            async with asyncio.timeout(plan.timeout_s):
                if conn.writer is None:
                    tally.connects += 1
                    await conn.open()
                status, headers = await conn.exchange(head, body)
            if headers.get("connection", "").lower() == "close":
                tally.server_closes += 1
                conn.close()
            if status == 503 and "retry-after" not in headers and "grpc-status" not in headers:
                tally.retry_after_missing += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, TimeoutError,
                asyncio.LimitOverrunError, _ProtocolError, ValueError) as exc:
            kind = _error_kind(exc)
            conn.close()
            if len(tally.error_examples) < 5:
                tally.error_examples.append(f"{kind}: {type(exc).__name__}: {exc}"[:200])
        finally:
            tally.in_flight -= 1
        done = clock()
        tally.last_done = done
        tally.records.append((sent - t0, done - sent, status))
        if kind is None:
            tally.statuses[status] = tally.statuses.get(status, 0) + 1
        else:
            tally.errors[kind] += 1
            if kind == "refused":
                await asyncio.sleep(0.05)  # do not spin on a port that is not there

    reporter = asyncio.create_task(_report(tally, t0, progress)) if progress else None
    workers = [asyncio.create_task(worker()) for _ in range(plan.connections)]
    while not all(w.done() for w in workers):
        await asyncio.wait(workers, timeout=0.05)
        if tally.stopped_sending is None and (clock() >= end or tally.started >= plan.requests):
            tally.stopped_sending = min(clock(), end)
    if tally.stopped_sending is None:
        tally.stopped_sending = clock()
    if reporter is not None:
        reporter.cancel()
        _progress_line(tally, t0, progress, final=True)
    return _summary(plan, tally, t0, started_wall)


async def _report(tally: _Tally, t0: float, label: str) -> None:
    every = 1.0 if sys.stderr.isatty() else 5.0
    while True:
        await asyncio.sleep(every)
        _progress_line(tally, t0, label)


def _progress_line(tally: _Tally, t0: float, label: str, final: bool = False) -> None:
    elapsed = time.perf_counter() - t0
    done = len(tally.records)
    statuses = " ".join(f"{code}:{n}" for code, n in sorted(tally.statuses.items()))
    errors = sum(tally.errors.values())
    line = (f"  [{label}] {elapsed:6.1f}s  done {done:6d}  {statuses or '-'}  errors {errors}  "
            f"in flight {tally.in_flight:3d}  {done / elapsed if elapsed > 0 else 0:7.1f} req/s")
    if sys.stderr.isatty():
        print("\r" + line, end="\n" if final else "", file=sys.stderr, flush=True)
    elif not final:
        print(line, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in 0..100) of values; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def latency_summary(seconds: list[float]) -> dict:
    """Return count, mean, p50/p90/p99 and max in milliseconds."""
    ms = [s * 1000.0 for s in seconds]
    out = {"count": len(ms), "mean": round(sum(ms) / len(ms), 2) if ms else None}
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100)):
        value = percentile(ms, q)
        out[name] = None if value is None else round(value, 2)
    return out


def _summary(plan: LoadPlan, tally: _Tally, t0: float, started_wall: float) -> dict:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    first = tally.first_sent if tally.first_sent is not None else t0
    elapsed = (tally.last_done - first) if tally.last_done is not None else 0.0
    ok = tally.statuses.get(200, 0)
    by_status: dict[int, list[float]] = {}
    for _, latency, status in tally.records:
        by_status.setdefault(status, []).append(latency)
    return {
        "plan": {"port": plan.port, "path": plan.path, "connections": plan.connections,
                 "duration_s": plan.duration_s, "requests": plan.requests if plan.requests < MAX_REQUESTS else None,
                 "rate": plan.rate, "arrivals": plan.arrivals if plan.rate else None,
                 "timeout_s": plan.timeout_s, "bodies": len(plan.bodies),
                 "body_bytes_mean": round(sum(len(b) for b, _ in plan.bodies) / len(plan.bodies))},
        "started_at": started_wall,  # wall clock (time.time()) at the schedule's start
        "stopped_sending_s": round(tally.stopped_sending - t0, 3),  # since the start
        "elapsed_s": round(elapsed, 3),  # first send to last answer
        "requests": len(tally.records),
        "statuses": {str(code): n for code, n in sorted(tally.statuses.items())},
        "errors": dict(tally.errors),
        "error_total": sum(tally.errors.values()),
        "error_examples": tally.error_examples,
        "retry_after_missing": tally.retry_after_missing,
        "connects": tally.connects,
        "server_closes": tally.server_closes,
        "late_sends": tally.late_sends,
        "max_lateness_ms": round(tally.max_lateness_s * 1000, 1),
        "ok_per_s": round(ok / elapsed, 2) if elapsed > 0 else 0.0,
        "requests_per_s": round(len(tally.records) / elapsed, 2) if elapsed > 0 else 0.0,
        "latency_ms": latency_summary(by_status.get(200, [])),  # answers with 200 only
        "latency_ms_by_status": {str(code): latency_summary(v) for code, v in sorted(by_status.items())},
        "client_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "records": [[round(s, 4), round(lat * 1000, 2), code] for s, lat, code in tally.records],
    }


def run(plan: LoadPlan, progress: Optional[str] = None, records: bool = False) -> dict:
    """Run the plan in this process and return its summary (with per-request records if asked)."""
    summary = asyncio.run(_run(plan, progress))
    if not records:
        summary.pop("records")
    return summary


def read_bodies(folder: Path) -> tuple[tuple[bytes, str], ...]:
    """Read the images in a folder (jpg, jpeg, png), in name order, as (body, content type)."""
    files = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in CONTENT_TYPES)
    return tuple((p.read_bytes(), CONTENT_TYPES[p.suffix.lower()]) for p in files)


def spawn(port: int, images: Path, out: Path, connections: int, duration_s: float,
          requests: Optional[int] = None, rate: Optional[float] = None, timeout_s: float = 60.0,
          start_delay_s: float = 0.0, records: bool = False, label: Optional[str] = None,
          arrivals: str = "uniform", seed: int = 0, v2_model: Optional[str] = None,
          grpc_model: Optional[str] = None, path: Optional[str] = None, v2_json_model: Optional[str] = None,
          v1_model: Optional[str] = None) -> subprocess.Popen:
    """Start the load generator in a process of its own, writing its JSON summary to `out`."""
    args = [sys.executable, "-m", "tools.loadgen", "--port", str(port), "--images", str(Path(images).resolve()),
            "--connections", str(connections), "--duration", f"{duration_s:g}", "--timeout", f"{timeout_s:g}",
            "--out", str(Path(out).resolve())]
    if v2_model:
        args += ["--v2-model", v2_model]
    if grpc_model:
        args += ["--grpc-model", grpc_model]
    if v2_json_model:
        args += ["--v2-json-model", v2_json_model]
    if v1_model:
        args += ["--v1-model", v1_model]
    if path:
        args += ["--path", path]
    if requests is not None:
        args += ["--requests", str(requests)]
    if rate is not None:
        args += ["--rate", f"{rate:.4f}", "--arrivals", arrivals, "--seed", str(seed)]
    if start_delay_s:
        args += ["--start-delay", f"{start_delay_s:g}"]
    if records:
        args.append("--records")
    if label:
        args += ["--progress", label]
    return subprocess.Popen(args, cwd=ROOT, stdin=subprocess.DEVNULL)  # ROOT: where `tools` is found


def collect(process: subprocess.Popen, out: Path, timeout_s: float) -> dict:
    """Wait for a spawned load generator and return its summary; raise RuntimeError if it failed."""
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise RuntimeError(f"the load generator did not finish within {timeout_s:.0f} s") from None
    if code != 0:
        raise RuntimeError(f"the load generator exited with status {code}")
    return json.loads(Path(out).read_text())


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.loadgen", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help=f"server port on {HOST}")
    parser.add_argument("--images", type=Path, required=True, help="folder of .jpg/.png files to POST in turn")
    parser.add_argument("--path", default="/detect")
    parser.add_argument("--v2-model", metavar="NAME", default=None,
                        help="POST each image to /v2/models/NAME/infer as a binary BYTES input instead")
    parser.add_argument("--v2-json-model", metavar="NAME", default=None,
                        help="POST each image to /v2/models/NAME/infer as a base64 BYTES input in JSON instead")
    parser.add_argument("--v1-model", metavar="NAME", default=None,
                        help="POST each image to /v1/models/NAME:predict as a KServe v1 b64 instance instead")
    parser.add_argument("--grpc-model", metavar="NAME", default=None,
                        help="call KServe v2 gRPC ModelInfer on NAME instead (--port is then the gRPC port)")
    parser.add_argument("--connections", "-c", type=int, default=1)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load (at most 3600)")
    parser.add_argument("--requests", "-n", type=int, default=None, help="stop after this many requests")
    parser.add_argument("--rate", type=float, default=None, help="pace sends at this many requests/s in all")
    parser.add_argument("--arrivals", choices=("uniform", "poisson"), default="uniform",
                        help="with --rate: even gaps, or exponential gaps as from independent clients")
    parser.add_argument("--seed", type=int, default=0, help="seed of the poisson gaps")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-request timeout (s)")
    parser.add_argument("--start-delay", type=float, default=0.0, help="wait before starting (s)")
    parser.add_argument("--records", action="store_true", help="include every request in the JSON")
    parser.add_argument("--progress", metavar="LABEL", default=None, help="print progress lines to stderr")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (default stdout)")
    args = parser.parse_args(argv)
    requests = MAX_REQUESTS if args.requests is None else args.requests
    bodies, lengths, path = read_bodies(args.images), (), args.path
    if args.v2_model:
        wrapped = [v2_binary_request(body) for body, _ in bodies]
        bodies = tuple((body, "application/octet-stream") for body, _ in wrapped)
        lengths, path = tuple(length for _, length in wrapped), f"/v2/models/{args.v2_model}/infer"
    if args.v2_json_model:
        bodies = tuple((v2_json_request(body), "application/json") for body, _ in bodies)
        path = f"/v2/models/{args.v2_json_model}/infer"
    if args.v1_model:
        bodies = tuple((v1_request(body), "application/json") for body, _ in bodies)
        path = f"/v1/models/{args.v1_model}:predict"
    if args.grpc_model:
        bodies = tuple((grpc_infer_request(args.grpc_model, body), "application/grpc") for body, _ in bodies)
        path = MODEL_INFER
    plan = LoadPlan(port=args.port, bodies=bodies, connections=args.connections,
                    duration_s=args.duration, requests=requests, rate=args.rate, arrivals=args.arrivals,
                    seed=args.seed, timeout_s=args.timeout, start_delay_s=args.start_delay, path=path,
                    header_lengths=lengths, grpc=bool(args.grpc_model))
    try:
        plan.check()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(run(plan, args.progress, args.records))
    if args.out is None:
        print(text)
    else:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
