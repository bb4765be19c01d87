"""The chaos soak's clients: mixed traffic over every protocol, each answer recorded and checked.

A client process runs `--threads` threads until its stop file appears. Each thread is a client of one model
(HOMES) and draws, from a seeded generator, one kind of request at a time (KINDS: raw, multipart and base64
/detect, KServe v2 JSON and binary, KServe v2 with its images in a registered system shared-memory region,
TF Serving REST, KServe v2 and TF Serving gRPC, KServe v2 on a gRPC stream, 12 MP photos, bad input from the
hardening battery, slow clients, and clients that send a whole request and hang up, over HTTP and gRPC, before
its answer), sends it on a fresh connection and writes one JSON line:

    {"t": send time (Unix s), "kind", "protocol", "model", "image", "status": the HTTP status (gRPC codes as
     their HTTP statuses, 0 when the connection failed), "ms", "outcome", "expected", ...}

`outcome` is "ok" for an answer in the documented shape, "mismatch" for detections that differ from the
reference answer of the same image (another request's boxes), or what went wrong ("reset", "closed",
"timeout", "refused", "bad-shape"). `expected` lists the statuses the documentation allows for that request.

The reference answers come from `references`, run by tools/chaos/run.py before any fault: every image through
each answer family once (the /detect JSON that raw, multipart, base64, v2 and gRPC KServe give; the raw
tensors of TF Serving REST and gRPC).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

HOST = "127.0.0.1"
TIMEOUT_S = 60.0
SCORE_FLOOR = 0.5  # raw tensors: the detections a /detect answer would keep at its default threshold
GRPC_AS_HTTP = {"OK": 200, "INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 503,
                "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "FAILED_PRECONDITION": 400}
# What the documentation allows for a well-formed request while the server is under faults: served, full or
# unavailable (503 with Retry-After), or past the deadline (504).
SERVED = (200, 503, 504)
MODELS = ("shapes", "objects", "faces")
# Each thread is one client of one model, as production traffic comes from separate populations: half of the
# threads use shapes all the time; a quarter use objects and a quarter faces, each in turns of TURN_S, objects
# while faces rests and the other way round, so that the budget (two workers) sees models come and go.
HOMES = ("shapes", "shapes", "objects", "faces")
TURN_S = 10.0
# kind: weight. A kind is one request shape on one protocol.
KINDS = {
    "detect-raw": 16, "model-raw": 10, "multipart": 6, "base64": 6, "v2-json": 8, "v2-binary": 8,
    "tfs-rest": 8, "grpc-kserve": 10, "grpc-tfs": 6, "photo-12mp": 2, "bad-input": 12, "slow-client": 4,
    "grpc-stream": 4, "v2-shm": 4, "hang-up": 3, "grpc-hang-up": 2,
}
HUNG_UP = 499  # a hang-up's record: the client closed its request, as nginx logs it; it reads no answer
FAMILY = {"detect-raw": "json", "model-raw": "json", "multipart": "json", "base64": "json", "v2-json": "json",
          "v2-binary": "json", "grpc-kserve": "json", "photo-12mp": "json", "tfs-rest": "tensors",
          "grpc-tfs": "tensors", "grpc-stream": "json", "v2-shm": "json"}
SHM_BYTES = 8 * 2**20  # each thread's shared-memory region: room for three scenes' JPEGs


class Images:
    """The scenes (names -> JPEG bytes) and the 12 MP photo."""

    def __init__(self, folder: Path):
        self.scenes = {p.stem: p.read_bytes() for p in sorted(folder.glob("scene-*.jpg"))}
        self.photo = (folder / "photo-12mp.jpg").read_bytes()


# Answers, reduced to what must not change between two requests for the same image ----------------------

def detections_of(result: dict) -> list:
    """A /detect image result's detections as sorted (class, box, score) tuples."""
    rows = []
    for d in result["detections"]:
        box = d["box"]
        rows.append((d["class_id"], box["x_min"], box["y_min"], box["x_max"], box["y_max"], d["score"]))
    return sorted(rows)


def tensors_of(boxes, scores, classes) -> list:
    """Raw detection tensors (one image) as sorted (class, box x 1000, score) tuples above SCORE_FLOOR."""
    rows = [(int(c), *(v * 1000 for v in box), s) for box, s, c in zip(boxes, scores, classes) if s >= SCORE_FLOOR]
    return sorted(rows)


def same(answer: list, reference: list) -> bool:
    """Whether two reduced answers agree, within what batching changes in float arithmetic."""
    if len(answer) != len(reference):
        return False
    for row, ref in zip(answer, reference):
        if row[0] != ref[0] or any(abs(a - b) > 1.0 + 0.01 * abs(b) for a, b in zip(row[1:-1], ref[1:-1])):
            return False
        if abs(row[-1] - ref[-1]) > 0.02:
            return False
    return True


# One request of each kind ------------------------------------------------------------------------------

class Answer:
    """What came back: the status, the reduced detections per image (None if not a 200), the raw facts."""

    def __init__(self, status: int, images: Optional[list] = None, **facts):
        self.status = status
        self.images = images
        self.facts = facts


def http_exchange(port: int, method: str, path: str, body: bytes = b"", headers: Optional[dict] = None,
                  timeout_s: float = TIMEOUT_S) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def _json_answer(status: int, headers: dict, body: bytes, images_of) -> Answer:
    facts = {"retry_after": headers.get("retry-after")}
    try:
        document = json.loads(body)
    except ValueError:
        return Answer(status, None, shape="not JSON", **facts)
    if status != 200:
        return Answer(status, None, error=_error_code(document), **facts)
    return Answer(status, images_of(document), **facts)


def _error_code(document) -> Optional[str]:
    error = document.get("error") if isinstance(document, dict) else None
    if isinstance(error, dict):
        return error.get("code")
    return "text" if isinstance(error, str) else None


def _detect_images(document: dict) -> list:
    results = document.get("results") or [document]
    return [detections_of(r) for r in results]


def _v2_images(document: dict) -> list:
    (output,) = [o for o in document["outputs"] if o["name"] == "detections"]
    return [detections_of(json.loads(item)) for item in output["data"]]


def send_json_kind(port: int, kind: str, model: str, images: list[bytes]) -> Answer:
    """Send one request of an HTTP kind whose answer is /detect JSON or v2; return the reduced answer."""
    if kind in ("detect-raw", "model-raw", "photo-12mp"):
        path = "/detect" if kind == "detect-raw" else f"/models/{model}/detect"
        status, headers, body = http_exchange(port, "POST", path, images[0], {"Content-Type": "image/jpeg"})
        return _json_answer(status, headers, body, _detect_images)
    if kind == "multipart":
        boundary = "chaos-boundary"
        parts = b"".join(
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"{i}.jpg\"\r\n"
            f"Content-Type: image/jpeg\r\n\r\n".encode() + image + b"\r\n" for i, image in enumerate(images))
        body = parts + f"--{boundary}--\r\n".encode()
        status, headers, answer = http_exchange(port, "POST", f"/models/{model}/detect", body,
                                                {"Content-Type": f"multipart/form-data; boundary={boundary}"})
        return _json_answer(status, headers, answer, _detect_images)
    if kind == "base64":
        body = json.dumps({"images": [base64.b64encode(i).decode() for i in images]}).encode()
        status, headers, answer = http_exchange(port, "POST", f"/models/{model}/detect", body,
                                                {"Content-Type": "application/json"})
        return _json_answer(status, headers, answer, _detect_images)
    if kind == "v2-json":
        body = json.dumps({"inputs": [{"name": "image", "shape": [len(images)], "datatype": "BYTES",
                                       "parameters": {"content_type": "base64"},
                                       "data": [base64.b64encode(i).decode() for i in images]}],
                           "outputs": [{"name": "detections"}]}).encode()
        status, headers, answer = http_exchange(port, "POST", f"/v2/models/{model}/infer", body,
                                                {"Content-Type": "application/json"})
        return _json_answer(status, headers, answer, _v2_images)
    if kind == "v2-binary":
        elements = b"".join(len(i).to_bytes(4, "little") + i for i in images)
        header = json.dumps({"inputs": [{"name": "image", "shape": [len(images)], "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(elements)}}],
                             "outputs": [{"name": "detections", "parameters": {"binary_data": True}}]}).encode()
        status, headers, answer = http_exchange(
            port, "POST", f"/v2/models/{model}/infer", header + elements,
            {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))})
        if status != 200:
            return _json_answer(status, headers, answer, _v2_images)
        size = int(headers.get("inference-header-content-length", 0))
        document, rest = json.loads(answer[:size]), answer[size:]
        items = []
        while rest:
            length = int.from_bytes(rest[:4], "little")
            items.append(detections_of(json.loads(rest[4:4 + length])))
            rest = rest[4 + length:]
        return Answer(200, items, outputs=[o["name"] for o in document["outputs"]])
    if kind == "tfs-rest":
        body = json.dumps({"instances": [{"b64": base64.b64encode(i).decode()} for i in images]}).encode()
        status, headers, answer = http_exchange(port, "POST", f"/v1/models/{model}:predict", body,
                                                {"Content-Type": "application/json"})

        def tensors(document):
            return [tensors_of(p["detection_boxes"], p["detection_scores"], p["detection_classes"])
                    for p in document["predictions"]]
        return _json_answer(status, headers, answer, tensors)
    raise ValueError(f"not a JSON kind: {kind}")


class SharedRegion:
    """One thread's POSIX shared-memory object, registered with the server as a region of the same name on first
    use (again after a refusal), for v2 requests whose images travel in it (Triton's system shared memory)."""

    def __init__(self):
        self.name = f"chaos-{os.getpid()}-{threading.get_ident()}"
        self.path = f"/dev/shm/{self.name}"
        with open(self.path, "wb") as region:
            region.truncate(SHM_BYTES)
        self.registered = False

    def send(self, port: int, model: str, images: list[bytes]) -> Answer:
        if not self.registered:
            body = json.dumps({"key": "/" + self.name, "offset": 0, "byte_size": SHM_BYTES}).encode()
            status, headers, answer = http_exchange(port, "POST", f"/v2/systemsharedmemory/region/{self.name}/register",
                                                    body, {"Content-Type": "application/json"})
            if status != 200:
                return _json_answer(status, headers, answer, _v2_images)
            self.registered = True
        elements = b"".join(len(i).to_bytes(4, "little") + i for i in images)
        with open(self.path, "r+b") as region:
            region.write(elements)
        body = json.dumps({"inputs": [{"name": "image", "shape": [len(images)], "datatype": "BYTES", "parameters": {
            "shared_memory_region": self.name, "shared_memory_byte_size": len(elements)}}],
            "outputs": [{"name": "detections"}]}).encode()
        status, headers, answer = http_exchange(port, "POST", f"/v2/models/{model}/infer", body,
                                                {"Content-Type": "application/json"})
        return _json_answer(status, headers, answer, _v2_images)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class GrpcClient:
    """One channel per thread, for KServe v2's ModelInfer and TF Serving's Predict."""

    def __init__(self, port: int):
        import grpc

        from app.grpc.protos import grpc_service_pb2, grpc_service_pb2_grpc
        from app.grpc.protos.tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2
        from app.grpc.protos.tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

        self.grpc, self.kserve, self.predict, self.tensor = grpc, grpc_service_pb2, predict_pb2, tensor_pb2
        self.shape, self.types = tensor_shape_pb2, types_pb2
        self.channel = grpc.insecure_channel(f"{HOST}:{port}")
        self.infer = grpc_service_pb2_grpc.GRPCInferenceServiceStub(self.channel).ModelInfer
        self.stream = grpc_service_pb2_grpc.GRPCInferenceServiceStub(self.channel).ModelStreamInfer
        self.tfs = prediction_service_pb2_grpc.PredictionServiceStub(self.channel).Predict

    def send(self, kind: str, model: str, images: list[bytes]) -> Answer:
        try:
            if kind in ("grpc-kserve", "grpc-stream"):
                pb = self.kserve
                request = pb.ModelInferRequest(
                    model_name=model, id="chaos",
                    inputs=[pb.ModelInferRequest.InferInputTensor(name="image", datatype="BYTES", shape=[len(images)])],
                    outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="detections")],
                    raw_input_contents=[b"".join(len(i).to_bytes(4, "little") + i for i in images)])
                if kind == "grpc-stream":  # one request on a stream of its own: answered on the stream
                    (streamed,) = list(self.stream(iter([request]), timeout=TIMEOUT_S))
                    if streamed.error_message:
                        return Answer(_stream_status(streamed.error_message), None, grpc="STREAM_ERROR",
                                      error=streamed.error_message[:200])
                    response = streamed.infer_response
                else:
                    response = self.infer(request, timeout=TIMEOUT_S)
                (index,) = [n for n, o in enumerate(response.outputs) if o.name == "detections"]
                rest, items = response.raw_output_contents[index], []
                while rest:
                    length = int.from_bytes(rest[:4], "little")
                    items.append(detections_of(json.loads(rest[4:4 + length])))
                    rest = rest[4 + length:]
                return Answer(200, items)
            request = self.predict.PredictRequest()
            request.model_spec.name = model
            request.inputs["input_tensor"].CopyFrom(self.tensor.TensorProto(
                dtype=self.types.DT_STRING, string_val=images,
                tensor_shape=self.shape.TensorShapeProto(dim=[self.shape.TensorShapeProto.Dim(size=len(images))])))
            response = self.tfs(request, timeout=TIMEOUT_S)
            arrays = {name: _float_array(t) for name, t in response.outputs.items()}
            boxes, scores, classes = (arrays[n] for n in ("detection_boxes", "detection_scores", "detection_classes"))
            per = len(scores) // len(images)  # detections per image: [N, K] flattened; boxes [N, K, 4]
            items = [tensors_of([boxes[4 * j:4 * j + 4] for j in range(i * per, (i + 1) * per)],
                                scores[i * per:(i + 1) * per], classes[i * per:(i + 1) * per])
                     for i in range(len(images))]
            return Answer(200, items)
        except self.grpc.RpcError as exc:
            code = exc.code().name
            retry = dict(exc.trailing_metadata() or ()).get("retry-after") if hasattr(exc, "trailing_metadata") else None
            return Answer(GRPC_AS_HTTP.get(code, 500), None, grpc=code, retry_after=retry)

    def hang_up(self, model: str, image: bytes, after_s: float) -> None:
        """Send one ModelInfer and cancel it `after_s` later, as a client that gave up does."""
        pb = self.kserve
        request = pb.ModelInferRequest(
            model_name=model, inputs=[pb.ModelInferRequest.InferInputTensor(name="image", datatype="BYTES", shape=[1])],
            raw_input_contents=[len(image).to_bytes(4, "little") + image])
        call = self.infer.future(request, timeout=TIMEOUT_S)
        time.sleep(after_s)
        call.cancel()

    def close(self) -> None:
        self.channel.close()


def hang_up(port: int, model: str, image: bytes, after_s: float) -> None:
    """Send a whole POST /models/{model}/detect and close the connection `after_s` later, unread: the client went."""
    with socket.create_connection((HOST, port), timeout=TIMEOUT_S) as sock:
        sock.sendall(f"POST /models/{model}/detect HTTP/1.1\r\nHost: chaos\r\nContent-Type: image/jpeg\r\n"
                     f"Content-Length: {len(image)}\r\n\r\n".encode() + image)
        time.sleep(after_s)


def _stream_status(message: str) -> int:
    """The HTTP status a stream's error_message stands for (a stream answer has a message and no code): a bug is
    500, a deadline 504, and the rest of what a well-formed request may meet (full, unavailable) 503."""
    if "internal error" in message:
        return 500
    return 504 if "deadline" in message.lower() or "within" in message.lower() else 503


def _float_array(tensor) -> list[float]:
    if tensor.float_val:
        return list(tensor.float_val)
    import numpy as np

    return np.frombuffer(tensor.tensor_content, dtype=np.float32).tolist()


# Bad input and slow clients ----------------------------------------------------------------------------

def bad_inputs(images: Images) -> list[tuple[str, str, bytes, dict, tuple[int, ...]]]:
    """The hardening battery's cases that any model meets: (name, path, body, headers, allowed statuses)."""
    scene = next(iter(images.scenes.values()))
    return [
        ("garbage-png", "/detect", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8, {"Content-Type": "image/png"}, (400,)),
        ("truncated-jpeg", "/models/shapes/detect", scene[: len(scene) // 3], {"Content-Type": "image/jpeg"}, (400,)),
        ("wrong-type", "/detect", scene, {"Content-Type": "text/plain"}, (415,)),
        ("bad-json", "/models/shapes/detect", b'{"images": [', {"Content-Type": "application/json"}, (400,)),
        ("bad-base64", "/models/shapes/detect", b'{"image": "***"}', {"Content-Type": "application/json"}, (400,)),
        ("v2-bad-shape", "/v2/models/shapes/infer",
         json.dumps({"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES", "data": ["x"]}]}).encode(),
         {"Content-Type": "application/json"}, (400,)),
        ("tfs-no-instances", "/v1/models/shapes:predict", b'{"signature_name": "serving_default"}',
         {"Content-Type": "application/json"}, (400,)),
        ("unknown-model", "/models/nosuch/detect", scene, {"Content-Type": "image/jpeg"}, (404,)),
        ("bad-threshold", "/detect?threshold=2", scene, {"Content-Type": "image/jpeg"}, (400,)),
        ("too-large", "/detect", b"\xff\xd8" + b"\0" * (21 * 2**20), {"Content-Type": "image/jpeg"}, (413,)),
    ]


def slow_client(port: int, rng: random.Random, header_timeout_s: float, body_timeout_s: float) -> dict:
    """A slowloris drip of headers, or a body that stalls: the server must close it at its deadline."""
    drip = rng.random() < 0.5
    limit = header_timeout_s if drip else body_timeout_s
    started = time.monotonic()
    record = {"kind": "slow-client", "protocol": "http", "case": "slowloris" if drip else "stalled-body",
              "limit_s": limit, "expected": [0]}
    try:
        sock = socket.create_connection((HOST, port), timeout=limit + 10)
    except OSError as exc:
        return {**record, "status": 0, "outcome": failure(exc), "closed_after_s": 0.0}
    try:
        if drip:
            sock.sendall(b"POST /detect HTTP/1.1\r\n")
            while time.monotonic() - started < limit + 10:
                sock.sendall(b"X-Drip: 1\r\n")
                if _closed_within(sock, 1.0):
                    break
        else:
            sock.sendall(b"POST /detect HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: 100000\r\n"
                         b"\r\n" + b"\xff\xd8" * 10)
            _closed_within(sock, limit + 10)
        closed_after = time.monotonic() - started
    except OSError:
        closed_after = time.monotonic() - started  # a reset is a close too
    finally:
        sock.close()
    return {**record, "closed_after_s": round(closed_after, 2), "status": 0,
            "outcome": "closed" if closed_after <= limit + 5 else "held-open"}


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Read until the peer closes (True) or `seconds` pass (False); an answer's bytes are read and dropped."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except socket.timeout:
            return False
        except OSError:
            return True
    return False


# The client process --------------------------------------------------------------------------------------

class Client:
    """One thread's loop of drawn requests, each written as a JSON line."""

    def __init__(self, args, images: Images, references: dict, out, lock: threading.Lock, seed: int, home: str):
        self.args, self.images, self.references, self.out, self.lock = args, images, references, out, lock
        self.home = home
        self.rng = random.Random(seed)
        self.bad = bad_inputs(images)
        self.grpc: Optional[GrpcClient] = None
        self.shm: Optional[SharedRegion] = None

    def resting(self) -> bool:
        """Whether this thread's model is out of its turn (objects and faces take turns; shapes never rests)."""
        if self.home == "shapes":
            return False
        turn = int((time.time() - self.args.epoch) / TURN_S) % 2
        return turn != (0 if self.home == "objects" else 1)

    def run(self, stop: threading.Event) -> None:
        # The default model's routes (/detect, the 12 MP photo to shapes) belong to the shapes clients.
        own = {k: w for k, w in KINDS.items() if self.home == "shapes" or k not in ("detect-raw", "photo-12mp")}
        kinds, weights = zip(*own.items())
        while not stop.is_set():
            if self.resting():
                stop.wait(0.2)
                continue
            kind = self.rng.choices(kinds, weights)[0]
            record = self.one(kind)
            with self.lock:
                self.out.write(json.dumps(record) + "\n")
            # As a well-behaved client does: after a 503, wait as long as Retry-After says (at most a second);
            # after a refused connection, half a second.
            if record["status"] == 503:
                stop.wait(min(1.0, float(record.get("retry_after") or 1.0)))
            elif record["status"] == 0 and record["outcome"] == "refused":
                stop.wait(0.5)
        if self.grpc is not None:
            self.grpc.close()
        if self.shm is not None:
            self.shm.close()

    def one(self, kind: str) -> dict:
        args, rng = self.args, self.rng
        if kind == "slow-client":
            return {"t": time.time(), **slow_client(args.port, rng, args.header_timeout_s, args.body_timeout_s)}
        started, wall = time.monotonic(), time.time()
        record = {"t": wall, "kind": kind, "protocol": "grpc" if kind.startswith("grpc") else "http"}
        if kind in ("hang-up", "grpc-hang-up"):
            image = rng.choice(list(self.images.scenes.values()))
            record.update(model=self.home, expected=[HUNG_UP])
            try:
                if kind == "hang-up":
                    hang_up(args.port, self.home, image, rng.uniform(0.0, 0.3))
                else:
                    if self.grpc is None:
                        self.grpc = GrpcClient(args.grpc_port)
                    self.grpc.hang_up(self.home, image, rng.uniform(0.0, 0.3))
                record.update(status=HUNG_UP, outcome="ok")
            except OSError as exc:
                record.update(status=0, outcome=failure(exc))
            record["ms"] = round((time.monotonic() - started) * 1000, 1)
            return record
        if kind == "bad-input":
            case, path, body, headers, allowed = rng.choice(self.bad)
            # A server that is full or stopping refuses before it reads the body: 503 with Retry-After.
            record.update(case=case, expected=[*allowed, 503])
            try:
                status, answer_headers, answer = http_exchange(args.port, "POST", path, body, headers)
                record.update(status=status, outcome="ok" if _error_code(_loads(answer)) else "bad-shape")
                if answer_headers.get("retry-after"):
                    record["retry_after"] = answer_headers["retry-after"]
            except OSError as exc:
                record.update(status=0, outcome=failure(exc))
            record["ms"] = round((time.monotonic() - started) * 1000, 1)
            return record
        model = self.home
        names = list(self.images.scenes)
        count = rng.choice((1, 1, 2, 3)) if kind in ("multipart", "base64", "v2-json", "v2-binary", "tfs-rest",
                                                     "grpc-kserve", "grpc-tfs", "grpc-stream", "v2-shm") else 1
        picked = ["photo-12mp"] if kind == "photo-12mp" else [rng.choice(names) for _ in range(count)]
        blobs = [self.images.photo if p == "photo-12mp" else self.images.scenes[p] for p in picked]
        record.update(model=model, images=picked, expected=list(SERVED))
        try:
            if kind.startswith("grpc"):
                if self.grpc is None:
                    self.grpc = GrpcClient(args.grpc_port)
                answer = self.grpc.send(kind, model, blobs)
            elif kind == "v2-shm":
                if self.shm is None:
                    self.shm = SharedRegion()
                answer = self.shm.send(args.port, model, blobs)
            else:
                answer = send_json_kind(args.port, kind, model, blobs)
        except OSError as exc:
            record.update(status=0, outcome=failure(exc), ms=round((time.monotonic() - started) * 1000, 1))
            return record
        except (ValueError, KeyError, TypeError) as exc:
            record.update(status=200, outcome="bad-shape", detail=repr(exc)[:200],
                          ms=round((time.monotonic() - started) * 1000, 1))
            return record
        record.update(status=answer.status, ms=round((time.monotonic() - started) * 1000, 1),
                      **{k: v for k, v in answer.facts.items() if v is not None})
        record["outcome"] = self.check(kind, model, picked, answer)
        return record

    def check(self, kind: str, model: str, picked: list[str], answer: Answer) -> str:
        if answer.status != 200:
            return "ok" if answer.facts.get("error") or answer.facts.get("grpc") else "bad-shape"
        if answer.images is None or len(answer.images) != len(picked):
            return "bad-shape"
        for name, got in zip(picked, answer.images):
            reference = self.references.get(f"{FAMILY[kind]}/{model}/{name}")
            if reference is not None and not same(got, reference):
                return "mismatch"
        return "ok"


def _loads(body: bytes):
    try:
        return json.loads(body)
    except ValueError:
        return None


def failure(exc: OSError) -> str:
    """What went wrong with a connection, in a word ("closed": closed by the server without an answer)."""
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, http.client.RemoteDisconnected):  # before reset: it is a ConnectionResetError too
        return "closed"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return "reset"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timeout"
    return type(exc).__name__


def references(port: int, grpc_port: int, images: Images) -> dict:
    """Each scene's answer, once per family and model, taken before any fault: 'family/model/scene' -> rows."""
    found = {}
    grpc_client = GrpcClient(grpc_port)
    try:
        for model in MODELS:
            for name, blob in images.scenes.items():
                json_answer = send_json_kind(port, "model-raw", model, [blob])
                tensor_answer = grpc_client.send("grpc-tfs", model, [blob])
                if json_answer.status != 200 or tensor_answer.status != 200:
                    raise RuntimeError(f"no reference answer for {model}/{name}: {json_answer.status}, "
                                       f"{tensor_answer.status} {tensor_answer.facts}")
                found[f"json/{model}/{name}"], = json_answer.images
                found[f"tensors/{model}/{name}"], = tensor_answer.images
            photo = send_json_kind(port, "photo-12mp", "shapes", [images.photo])
            if photo.status == 200:
                found["json/shapes/photo-12mp"], = photo.images
    finally:
        grpc_client.close()
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.chaos.traffic", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--images", type=Path, required=True)
    parser.add_argument("--references", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per request")
    parser.add_argument("--threads", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epoch", type=float, default=0.0, help="Unix time the models' turns count from")
    parser.add_argument("--first-thread", type=int, default=0, help="this process's first thread's number")
    parser.add_argument("--stop-file", type=Path, required=True, help="the clients finish once it exists")
    parser.add_argument("--header-timeout-s", type=float, default=10.0)
    parser.add_argument("--body-timeout-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    images = Images(args.images)
    refs = json.loads(args.references.read_text())
    stop, lock = threading.Event(), threading.Lock()
    with args.out.open("w", buffering=1) as out:
        clients = [Client(args, images, refs, out, lock, args.seed * 1000 + i,
                          HOMES[(args.first_thread + i) % len(HOMES)]) for i in range(args.threads)]
        threads = [threading.Thread(target=c.run, args=(stop,), daemon=True) for c in clients]
        for thread in threads:
            thread.start()
        while not args.stop_file.exists():
            time.sleep(0.2)
        stop.set()
        for thread in threads:
            thread.join(TIMEOUT_S + 15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
