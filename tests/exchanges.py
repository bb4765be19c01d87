"""Record the server's answers to a fixed set of HTTP and gRPC exchanges, and replay them to check they are unchanged.

A restructuring of the protocol layers must leave every route's and method's answer byte for byte the same.
`record` starts a real server on the blob model (tests/blob_model.py, whose answers are exact), sends the
exchanges planned here in order, and writes each request with its answer to tests/exchanges.json; the test
(tests/test_exchanges.py) sends the recorded requests to a server of the current code and compares.

An HTTP answer is its status, its headers and its body: JSON bodies parsed, with their exact layout checked
(`layout`); the page's files by SHA-256; Prometheus text by line; others as text or base64. A gRPC answer is its
status code, its details and the response message(s) in protobuf text format (map entries sorted by key). Message
classes come from the server's own reflection service, so the recorded file needs no generated code to be read.

Only what truly differs from run to run is replaced by a placeholder, its key kept: see Normalization below.

Record anew (only on code whose answers are known to be right):
    PYTHONPATH=. python tests/exchanges.py --record
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import http.client
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from google.protobuf import json_format, text_format
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass

from blob_model import blob_image, build_blob_model
from images_for_tests import encode

RECORDED = Path(__file__).resolve().parent / "exchanges.json"
MODEL = "blob"
ADMIN_HEADER, ADMIN_KEY = "admin-key", "exchange-test-key"
ORIGIN = "https://page.example"
MAX_BODY_BYTES = 64 * 1024
# The server every exchange is sent to: the blob model (versions 1 and 2, 2 served), the model repository
# restricted to a header (so both the refusal and the granted call are recorded), CORS for one origin. A
# video's frames go to the model one at a time: with more in flight, how many share a call depends on timing,
# and the statistics recorded after them (a CI run once batched two of them) would too.
SERVER_ENV = {
    "DETECT_MAX_BODY_BYTES": str(MAX_BODY_BYTES), "DETECT_MAX_IMAGES_PER_REQUEST": "4",
    "DETECT_IDLE_UNLOAD_S": "0", "DETECT_SPARE_WORKERS": "0", "DETECT_VIDEO_FRAMES_IN_FLIGHT": "1",
    "DETECT_RESTRICTED_API": f"model-repository:{ADMIN_HEADER}={ADMIN_KEY}",
    "DETECT_CORS_ORIGINS": ORIGIN,
}

HEADER_LENGTH = "Inference-Header-Content-Length"  # KServe's binary form: the JSON header's length
PAGE_TYPES = ("text/html", "text/css", "text/javascript", "image/svg+xml")  # recorded by digest: long, not data

RED_GREEN = blob_image(16, 12, {1: (2, 1, 6, 5), 2: (8, 5, 14, 10)})
BLUE = blob_image(8, 8, {3: (1, 1, 4, 4)})
EMPTY = blob_image(6, 4, {})
PNG, BLUE_PNG, EMPTY_PNG = encode(RED_GREEN), encode(BLUE), encode(EMPTY)
JPEG = encode(RED_GREEN, "JPEG", quality=100, subsampling=0)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# Normalization --------------------------------------------------------------------------------------------------

PLACEHOLDER = "<varies>"
# Headers whose values differ from run to run: the clock (Date, and Expires, which the page's files derive from it),
# the files' mtimes (ETag, Last-Modified), Twisted's version (Server). Content-Length too, where the body had
# values replaced (see http_answer). The header stays; its value becomes PLACEHOLDER.
VARYING_HEADERS = {"date", "expires", "etag", "last-modified", "server"}
# JSON keys whose values differ from run to run: times, process ids, memory figures, timestamps. The key stays;
# each number or string below it becomes PLACEHOLDER (so a dict keeps its keys, a list its length).
VARYING_KEYS = {
    "timing_ms",  # /detect's decode, inference, total and stage times
    "pid", "rss_mib", "memory",  # worker processes and what they hold
    "hardware",  # the CPU or GPU a model computes on (its precision's reason names the machine)
    "last_load_s", "last_used_unix", "last_load_unix", "now_unix",
    "ns", "last_inference",  # the statistics extension's times (its counts are kept)
}
# The same fields in a protobuf message's text (gRPC ModelStatistics).
VARYING_FIELDS = re.compile(r"\b(ns|last_inference): \d+")
# JSON keys whose whole value becomes PLACEHOLDER: /gpu/history's samples, one a second since boot.
VARYING_LISTS = {"samples"}
# JSON keys below which objects are protobuf maps, whose order protobuf leaves unspecified (/v1's signature_def
# came back in a different order from run to run): their keys are sorted, at every depth below.
UNORDERED_MAPS = {"signature_def"}
# The model data (tests/blob_model.py) is exact, and its floats came back bit for bit the same in every run:
# none are rounded.
METRIC_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?) (\S+)$", re.M)


def _placeholders(value):
    if isinstance(value, dict):
        return {key: _placeholders(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_placeholders(item) for item in value]
    return PLACEHOLDER if value is not None else None


def _sorted_maps(value):
    if isinstance(value, dict):
        return {key: _sorted_maps(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_maps(item) for item in value]
    return value


def normalize_json(value, model_base: str):
    """Replace what VARYING_KEYS and VARYING_LISTS name by PLACEHOLDER (keys kept), sort UNORDERED_MAPS, and
    write the run's model folder as <model_base>."""
    if isinstance(value, dict):
        return {key: PLACEHOLDER if key in VARYING_LISTS else _placeholders(item) if key in VARYING_KEYS
                else _sorted_maps(normalize_json(item, model_base)) if key in UNORDERED_MAPS
                else normalize_json(item, model_base) for key, item in value.items()}
    if isinstance(value, list):
        return [normalize_json(item, model_base) for item in value]
    if isinstance(value, str) and model_base:
        return value.replace(model_base, "<model_base>")
    return value


# Metrics whose values are kept: the counts of the exchanges themselves, sent in a fixed order.
COUNTED_METRICS = ("detect_http_requests_total{", "detect_grpc_requests_total{")


def normalize_metrics(text: str) -> str:
    """Keep every series' name and labels; replace each sample's value (times, memory, counts of model calls that
    batching may split differently), but COUNTED_METRICS'."""
    return METRIC_SAMPLE.sub(lambda m: m.group(0) if m.group(1).startswith(COUNTED_METRICS)
                             else f"{m.group(1)} {PLACEHOLDER}", text)


def normalize_headers(headers: list[tuple[str, str]], body_normalized: bool) -> list[list[str]]:
    """Lowercase names, sorted; VARYING_HEADERS' values (and Content-Length's, if the body was) by PLACEHOLDER;
    Allow's methods sorted (Werkzeug lists a set of them, in an order that differs from run to run)."""
    varying = VARYING_HEADERS | ({"content-length"} if body_normalized else set())

    def value_of(name: str, value: str) -> str:
        if name in varying:
            return PLACEHOLDER
        if name == "detections":  # a picture answer's JSON answer, with its timings
            return json.dumps(normalize_json(json.loads(value), ""), separators=(",", ":"))
        return ", ".join(sorted(v.strip() for v in value.split(","))) if name == "allow" else value

    return sorted([name.lower(), value_of(name.lower(), value)] for name, value in headers)


# HTTP -----------------------------------------------------------------------------------------------------------


def http_exchange(name: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                  fill: int = 0) -> dict:
    """Plan one HTTP exchange; `fill` sends that many zero bytes as the body (kept short in the file)."""
    request = {"method": method, "path": path, "headers": dict(headers or {})}
    if fill:
        request["body_fill"] = fill
    elif body is not None:
        kind = request["headers"].get("Content-Type", "")
        if "json" in kind and "Content-Encoding" not in request["headers"] and HEADER_LENGTH not in request["headers"]:
            request["body_text"] = body.decode()
        else:
            request["body_base64"] = b64(body)
    return {"name": name, "protocol": "http", "request": request}


def request_body(request: dict) -> bytes | None:
    if "body_fill" in request:
        return bytes(request["body_fill"])
    if "body_text" in request:
        return request["body_text"].encode()
    if "body_base64" in request:
        return base64.b64decode(request["body_base64"])
    return None


def send_http(port: int, request: dict) -> tuple[int, list[tuple[str, str]], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(request["method"], request["path"], body=request_body(request), headers=request["headers"])
        response = conn.getresponse()
        return response.status, response.getheaders(), response.read()
    finally:
        conn.close()


def _json_layout(data: bytes):
    """The parsed JSON body and the layout its bytes have (checked exactly), or None if it is not JSON."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    for layout, options in (("compact", {"separators": (",", ":")}), ("spaced", {})):
        for end in ("\n", ""):
            if json.dumps(parsed, **options).encode() + end.encode() == data:
                return parsed, layout + ("+newline" if end else "")
    return None


def http_answer(status: int, headers: list[tuple[str, str]], data: bytes, model_base: str) -> dict:
    """The answer as recorded: status, headers, and the body in its most readable exact form, normalized."""
    body = _body(dict((name.lower(), value) for name, value in headers), data, model_base)
    return {"status": status, "headers": normalize_headers(headers, body.pop("normalized", False)), "body": body}


def _body(headers: dict, data: bytes, model_base: str) -> dict:
    kind = headers.get("content-type", "")
    if not data:
        return {"empty": True}
    if HEADER_LENGTH.lower() in headers:  # KServe's binary form: a JSON header, then the tensors' bytes
        split = int(headers[HEADER_LENGTH.lower()])
        header = _json_layout(data[:split])
        if header is not None:
            normalized = normalize_json(header[0], model_base)
            return {"json_header": normalized, "layout": header[1], "binary_base64": b64(data[split:]),
                    "normalized": normalized != header[0]}
    if kind.startswith("application/x-ndjson"):  # a video's records, one JSON document a line
        return {"ndjson": [normalize_json(json.loads(line), model_base) for line in data.splitlines() if line],
                "normalized": True}
    if "json" in kind:
        parsed = _json_layout(data)
        if parsed is not None:
            normalized = normalize_json(parsed[0], model_base)
            return {"json": normalized, "layout": parsed[1], "normalized": normalized != parsed[0]}
    if kind.startswith(PAGE_TYPES):
        return {"sha256": hashlib.sha256(data).hexdigest(), "length": len(data)}
    if kind.startswith("text/plain; version=0.0.4"):  # Prometheus' exposition format
        return {"metrics": normalize_metrics(data.decode()).splitlines(), "normalized": True}
    try:
        return {"text": data.decode()}
    except UnicodeDecodeError:
        return {"base64": b64(data)}


# gRPC -----------------------------------------------------------------------------------------------------------


class GrpcPort:
    """A channel to the server's gRPC port and the message classes its reflection service describes."""

    def __init__(self, port: int):
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        database = ProtoReflectionDescriptorDatabase(self.channel)
        self.services = sorted(database.get_services())
        self.pool = DescriptorPool(database)

    def methods(self) -> list[str]:
        """Every method of every service the port serves, as full names: /package.Service/Method."""
        return [f"/{name}/{method.name}" for name in self.services
                for method in self.pool.FindServiceByName(name).methods]

    def method(self, full_name: str):
        """The method's descriptor, or None for a method the port does not describe."""
        service, _, method = full_name.strip("/").partition("/")
        if service not in self.services:
            return None
        return self.pool.FindServiceByName(service).methods_by_name.get(method)

    def message(self, full_name: str, fields: dict):
        """A request message for `full_name` from JSON-style fields (bytes as base64)."""
        return json_format.ParseDict(fields, GetMessageClass(self.method(full_name).input_type)(),
                                     descriptor_pool=self.pool)

    def text(self, message) -> str:
        return text_format.MessageToString(message, descriptor_pool=self.pool)

    def close(self) -> None:
        self.channel.close()


def grpc_exchange(name: str, method: str, requests, metadata=(), take: int = 0, pad: int = 0) -> dict:
    """Plan one gRPC exchange: `requests` is one message's fields (a list of them for a client stream), or bytes
    for a method the port does not describe; `take` ends a server stream after that many answers; `pad` adds
    that many zero bytes to the first raw_input_contents (kept short in the file)."""
    request = {"method": method, "metadata": [list(pair) for pair in metadata], "planned": requests}
    if take:
        request["take"] = take
    if pad:
        request["pad"] = pad
    return {"name": name, "protocol": "grpc", "request": request}


def _written(port: GrpcPort, request: dict) -> dict:
    """The planned request as recorded: each message in text format (or base64 bytes for an undescribed method)."""
    planned = request.pop("planned")
    if port.method(request["method"]) is None:
        request["raw_base64"] = b64(planned)
    elif isinstance(planned, list):
        request["messages"] = [port.text(port.message(request["method"], fields)) for fields in planned]
    else:
        request["message"] = port.text(port.message(request["method"], planned))
    return request


def send_grpc(port: GrpcPort, request: dict) -> dict:
    """Send a recorded request; return the answer: code, details, and the message(s) in text format."""
    descriptor = port.method(request["method"])
    metadata = [tuple(pair) for pair in request["metadata"]]
    if descriptor is None:
        call = port.channel.unary_unary(request["method"], request_serializer=None, response_deserializer=None)
        return _unary_answer(port, lambda: call(base64.b64decode(request["raw_base64"]), metadata=metadata,
                                                timeout=120), raw=True)
    request_class = GetMessageClass(descriptor.input_type)
    response_class = GetMessageClass(descriptor.output_type)
    parse = lambda text: text_format.Parse(text, request_class(), descriptor_pool=port.pool)  # noqa: E731
    kinds = {(False, False): port.channel.unary_unary, (False, True): port.channel.unary_stream,
             (True, False): port.channel.stream_unary, (True, True): port.channel.stream_stream}
    call = kinds[descriptor.client_streaming, descriptor.server_streaming](
        request["method"], request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_class.FromString)
    if descriptor.client_streaming:
        sent = iter([parse(text) for text in request["messages"]])
    else:
        sent = parse(request["message"])
        if request.get("pad"):
            sent.raw_input_contents[0] += bytes(request["pad"])
    if not descriptor.server_streaming:
        return _unary_answer(port, lambda: call(sent, metadata=metadata, timeout=120))
    stream = call(sent, metadata=metadata, timeout=120)
    answers, take = [], request.get("take", 0)
    try:
        for message in stream:
            answers.append(port.text(message))
            if take and len(answers) == take:
                stream.cancel()
                return {"code": "OK", "details": "", "messages": answers, "ended": f"cancelled after {take}"}
        return {"code": "OK", "details": "", "messages": answers}
    except grpc.RpcError as error:
        return {"code": error.code().name, "details": error.details(), "messages": answers}


def _unary_answer(port: GrpcPort, call, raw: bool = False) -> dict:
    try:
        answer = call()
    except grpc.RpcError as error:
        return {"code": error.code().name, "details": error.details()}
    return {"code": "OK", "details": "",
            "message": b64(answer) if raw else VARYING_FIELDS.sub(rf"\1: {PLACEHOLDER}", port.text(answer))}


# The exchanges --------------------------------------------------------------------------------------------------

JSON = {"Content-Type": "application/json"}
ADMIN = {ADMIN_HEADER: ADMIN_KEY}
KSERVE = "/inference.GRPCInferenceService/"
PREDICTION = "/tensorflow.serving.PredictionService/"
MODEL_SERVICE = "/tensorflow.serving.ModelService/"
HEALTH = "/grpc.health.v1.Health/"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def _multipart(fields: list[tuple[str, bytes]], boundary: str = "exchangeboundary") -> tuple[bytes, dict]:
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="f{i}.png"\r\n'
             f"Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n" for i, (name, data) in enumerate(fields)]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def _json(value) -> bytes:
    return json.dumps(value).encode()


def _pixels(array: np.ndarray, **extra) -> dict:
    return {"name": "input_tensor", "shape": list(array.shape), "datatype": "UINT8", "data": array.ravel().tolist(),
            **extra}


def _binary_infer(array: np.ndarray, outputs: list[str]) -> tuple[bytes, dict]:
    header = _json({"inputs": [{"name": "input_tensor", "shape": list(array.shape), "datatype": "UINT8",
                                "parameters": {"binary_data_size": array.nbytes}}],
                    "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in outputs]})
    return header + array.tobytes(), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}


def http_exchanges() -> list[dict]:
    """Every HTTP route with its success and main refusals, in the order sent."""
    batch = RED_GREEN[None]
    multipart_two, multipart_headers = _multipart([("image", BLUE_PNG), ("image", PNG)])
    multipart_none, multipart_none_headers = _multipart([("file", PNG)])
    binary_body, binary_headers = _binary_infer(batch, ["num_detections", "detection_boxes"])
    v2_bytes = {"name": "image", "shape": [2], "datatype": "BYTES", "data": [b64(PNG), b64(BLUE_PNG)]}
    from videos_for_tests import make_video  # PyAV, the video extra, in the test extra

    video = make_video(frames=6, size=(32, 24))
    return [
        # The page and its files
        http_exchange("page", "GET", "/"),
        http_exchange("page css", "GET", "/static/page.css"),
        http_exchange("page script", "GET", "/static/page.js"),
        http_exchange("page icon", "GET", "/static/favicon.svg"),
        http_exchange("page file unknown", "GET", "/static/nope.txt"),
        # Operations
        http_exchange("healthz", "GET", "/healthz"),
        http_exchange("healthz head", "HEAD", "/healthz"),
        http_exchange("healthz method not allowed", "POST", "/healthz", b""),
        http_exchange("readyz", "GET", "/readyz"),
        http_exchange("gpu", "GET", "/gpu"),
        http_exchange("gpu history", "GET", "/gpu/history"),
        http_exchange("gpu history since", "GET", "/gpu/history?since=0"),
        http_exchange("gpu history bad since", "GET", "/gpu/history?since=soon"),
        http_exchange("gpu history unknown parameter", "GET", "/gpu/history?until=1"),
        http_exchange("no route", "GET", "/nope"),
        http_exchange("no route post", "POST", "/v3/models/blob/infer", b"{}", JSON),
        http_exchange("openapi", "GET", "/openapi.json"),
        http_exchange("cors preflight", "OPTIONS", "/detect",
                      headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "content-type, x-other"}),
        http_exchange("cors preflight other origin", "OPTIONS", "/detect",
                      headers={"Origin": "https://other.example", "Access-Control-Request-Method": "POST"}),
        http_exchange("cors simple request", "GET", "/healthz", headers={"Origin": ORIGIN}),
        # This service's own /detect and /models
        http_exchange("detect raw png", "POST", "/detect", PNG, {"Content-Type": "image/png"}),
        http_exchange("detect raw jpeg threshold", "POST", "/detect?threshold=0.2&max_detections=1", JPEG,
                      {"Content-Type": "image/jpeg"}),
        http_exchange("detect stages", "POST", "/detect?timing=stages", PNG, {"Content-Type": "image/png"}),
        http_exchange("detect multipart", "POST", "/detect?threshold=0.2", multipart_two, multipart_headers),
        http_exchange("detect multipart no image field", "POST", "/detect", multipart_none, multipart_none_headers),
        http_exchange("detect json one", "POST", "/detect", _json({"image": b64(PNG)}), JSON),
        http_exchange("detect json list", "POST", "/detect?threshold=0.2",
                      _json({"images": [b64(EMPTY_PNG), b64(BLUE_PNG)]}), JSON),
        http_exchange("detect json bad base64", "POST", "/detect", _json({"image": "!!!"}), JSON),
        http_exchange("detect json not json", "POST", "/detect", b"{not json", JSON),
        http_exchange("detect json no image", "POST", "/detect", _json({"picture": b64(PNG)}), JSON),
        http_exchange("detect too many images", "POST", "/detect", _json({"images": [b64(PNG)] * 5}), JSON),
        http_exchange("detect not an image", "POST", "/detect", b"not an image", {"Content-Type": "image/png"}),
        http_exchange("detect unsupported type", "POST", "/detect", b"hello", {"Content-Type": "text/plain"}),
        http_exchange("detect bad threshold", "POST", "/detect?threshold=2", PNG, {"Content-Type": "image/png"}),
        http_exchange("detect bad max_detections", "POST", "/detect?max_detections=0", PNG,
                      {"Content-Type": "image/png"}),
        http_exchange("detect unknown parameter", "POST", "/detect?colour=red", PNG, {"Content-Type": "image/png"}),
        # Pictures with their boxes drawn, and video (issue 44)
        http_exchange("detect picture png", "POST", "/detect?format=png", PNG, {"Content-Type": "image/png"}),
        http_exchange("detect picture by accept", "POST", "/detect?max_side=16", PNG,
                      {"Content-Type": "image/png", "Accept": "image/jpeg"}),
        http_exchange("detect picture of a list", "POST", "/detect?format=jpeg", _json({"images": [b64(PNG)]}), JSON),
        http_exchange("detect video", "POST", "/detect/video", video, {"Content-Type": "video/mp4"}),
        http_exchange("detect video named", "POST", f"/models/{MODEL}/detect/video?fps=10&threshold=0.2", video,
                      {"Content-Type": "video/mp4"}),
        http_exchange("detect video not a video", "POST", "/detect/video", b"not a video", {"Content-Type": "video/mp4"}),
        http_exchange("detect video bad fps", "POST", "/detect/video?fps=0", video, {"Content-Type": "video/mp4"}),
        http_exchange("detect body too large", "POST", "/detect", headers={"Content-Type": "image/png"},
                      fill=MAX_BODY_BYTES + 1),
        http_exchange("detect method not allowed", "GET", "/detect"),
        http_exchange("model detect", "POST", f"/models/{MODEL}/detect", PNG, {"Content-Type": "image/png"}),
        http_exchange("model detect unknown model", "POST", "/models/nope/detect", PNG, {"Content-Type": "image/png"}),
        http_exchange("models", "GET", "/models"),
        http_exchange("model", "GET", f"/models/{MODEL}"),
        http_exchange("model unknown", "GET", "/models/nope"),
        # KServe v2
        http_exchange("v2 server metadata", "GET", "/v2"),
        http_exchange("v2 live", "GET", "/v2/health/live"),
        http_exchange("v2 ready", "GET", "/v2/health/ready"),
        http_exchange("v2 model metadata", "GET", f"/v2/models/{MODEL}"),
        http_exchange("v2 model metadata version", "GET", f"/v2/models/{MODEL}/versions/2"),
        http_exchange("v2 model metadata version not served", "GET", f"/v2/models/{MODEL}/versions/1"),
        http_exchange("v2 model metadata unknown model", "GET", "/v2/models/nope"),
        http_exchange("v2 model ready", "GET", f"/v2/models/{MODEL}/ready"),
        http_exchange("v2 model ready version", "GET", f"/v2/models/{MODEL}/versions/2/ready"),
        http_exchange("v2 model ready version not served", "GET", f"/v2/models/{MODEL}/versions/1/ready"),
        http_exchange("v2 model ready unknown model", "GET", "/v2/models/nope/ready"),
        http_exchange("v2 model config", "GET", f"/v2/models/{MODEL}/config"),
        http_exchange("v2 model config version", "GET", f"/v2/models/{MODEL}/versions/2/config"),
        http_exchange("v2 model config version not served", "GET", f"/v2/models/{MODEL}/versions/1/config"),
        *unimplemented_http_exchanges(),
        http_exchange("v2 statistics", "GET", "/v2/models/stats"),
        http_exchange("v2 model statistics", "GET", f"/v2/models/{MODEL}/stats"),
        http_exchange("v2 model statistics version", "GET", f"/v2/models/{MODEL}/versions/2/stats"),
        http_exchange("v2 model statistics unknown model", "GET", "/v2/models/nope/stats"),
        http_exchange("v2 shm register", "POST", "/v2/systemsharedmemory/region/r/register",
                      _json({"key": SHM_KEY, "offset": 0, "byte_size": SHM_BYTES}), JSON),
        http_exchange("v2 shm register past the end", "POST", "/v2/systemsharedmemory/region/s/register",
                      _json({"key": SHM_KEY, "offset": 8, "byte_size": SHM_BYTES}), JSON),
        http_exchange("v2 shm status", "GET", "/v2/systemsharedmemory/status"),
        http_exchange("v2 shm region status", "GET", "/v2/systemsharedmemory/region/r/status"),
        http_exchange("v2 shm infer from and into a region", "POST", f"/v2/models/{MODEL}/infer", _json({
            "inputs": [{"name": "input_tensor", "datatype": "UINT8", "shape": [1, 4, 4, 3], "parameters": {
                "shared_memory_region": "r", "shared_memory_byte_size": 48}}],
            "outputs": [{"name": "num_detections", "parameters": {
                "shared_memory_region": "r", "shared_memory_byte_size": 64, "shared_memory_offset": 1024}}]}), JSON),
        http_exchange("v2 shm infer into an output place too small", "POST", f"/v2/models/{MODEL}/infer", _json({
            "inputs": [{"name": "input_tensor", "datatype": "UINT8", "shape": [1, 4, 4, 3], "parameters": {
                "shared_memory_region": "r", "shared_memory_byte_size": 48}}],
            "outputs": [{"name": "num_detections", "parameters": {
                "shared_memory_region": "r", "shared_memory_byte_size": 2, "shared_memory_offset": 1024}}]}), JSON),
        http_exchange("v2 shm register a name with a newline", "POST",
                      "/v2/systemsharedmemory/region/n%0A/register",
                      _json({"key": SHM_KEY, "offset": 0, "byte_size": SHM_BYTES}), JSON),
        http_exchange("v2 shm region unregister", "POST", "/v2/systemsharedmemory/region/r/unregister"),
        http_exchange("v2 shm unregister all", "POST", "/v2/systemsharedmemory/unregister"),
        http_exchange("v2 infer json pixels", "POST", f"/v2/models/{MODEL}/infer",
                      _json({"id": "pixels-1", "inputs": [_pixels(batch)]}), JSON),
        http_exchange("v2 infer timeout past any float", "POST", f"/v2/models/{MODEL}/infer",
                      _json({"inputs": [_pixels(batch)], "parameters": {"timeout": 10**310}}), JSON),
        http_exchange("v2 infer json files with detections", "POST", f"/v2/models/{MODEL}/versions/2/infer",
                      _json({"inputs": [v2_bytes], "parameters": {"threshold": 0.2, "max_detections": 2},
                             "outputs": [{"name": "num_detections"}, {"name": "detections"}]}), JSON),
        http_exchange("v2 infer binary", "POST", f"/v2/models/{MODEL}/infer", binary_body, binary_headers),
        http_exchange("v2 infer raw file", "POST", f"/v2/models/{MODEL}/infer", PNG,
                      {"Content-Type": "application/octet-stream", HEADER_LENGTH: "0"}),
        http_exchange("v2 infer gzip", "POST", f"/v2/models/{MODEL}/infer",
                      gzip.compress(_json({"inputs": [v2_bytes], "outputs": [{"name": "num_detections"}]}), mtime=0),
                      {**JSON, "Content-Encoding": "gzip"}),
        http_exchange("v2 infer bad gzip", "POST", f"/v2/models/{MODEL}/infer", b"not gzip",
                      {**JSON, "Content-Encoding": "gzip"}),
        http_exchange("v2 infer not json", "POST", f"/v2/models/{MODEL}/infer", b"{", JSON),
        http_exchange("v2 infer inputs not a list", "POST", f"/v2/models/{MODEL}/infer", _json({"inputs": "no"}), JSON),
        http_exchange("v2 infer unknown input", "POST", f"/v2/models/{MODEL}/infer",
                      _json({"inputs": [{**_pixels(batch), "name": "pixels"}]}), JSON),
        http_exchange("v2 infer wrong datatype", "POST", f"/v2/models/{MODEL}/infer",
                      _json({"inputs": [{**_pixels(batch), "datatype": "FP32"}]}), JSON),
        http_exchange("v2 infer shape disagrees with data", "POST", f"/v2/models/{MODEL}/infer",
                      _json({"inputs": [{**_pixels(batch), "shape": [1, 2, 2, 3]}]}), JSON),
        http_exchange("v2 infer unknown output", "POST", f"/v2/models/{MODEL}/infer",
                      _json({"inputs": [_pixels(batch)], "outputs": [{"name": "boxes"}]}), JSON),
        http_exchange("v2 infer bad parameter", "POST", f"/v2/models/{MODEL}/infer",
                      _json({"inputs": [_pixels(batch)], "parameters": {"threshold": 2}}), JSON),
        http_exchange("v2 infer unknown parameter", "POST", f"/v2/models/{MODEL}/infer",
                      _json({"inputs": [_pixels(batch)], "parameters": {"colour": "red"}}), JSON),
        http_exchange("v2 infer sequence parameter", "POST", f"/v2/models/{MODEL}/infer",
                      _json({"inputs": [_pixels(batch)], "parameters": {"sequence_id": 1}}), JSON),
        http_exchange("v2 infer not an image", "POST", f"/v2/models/{MODEL}/infer",
                      _json({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                         "data": [b64(b"not an image")]}]}), JSON),
        http_exchange("v2 infer version not served", "POST", f"/v2/models/{MODEL}/versions/1/infer",
                      _json({"inputs": [_pixels(batch)]}), JSON),
        http_exchange("v2 infer unknown model", "POST", "/v2/models/nope/infer", _json({"inputs": [_pixels(batch)]}),
                      JSON),
        http_exchange("v2 infer method not allowed", "GET", f"/v2/models/{MODEL}/infer"),
        # TF Serving REST
        http_exchange("v1 model status", "GET", f"/v1/models/{MODEL}"),
        http_exchange("v1 model status version", "GET", f"/v1/models/{MODEL}/versions/2"),
        http_exchange("v1 model status version not served", "GET", f"/v1/models/{MODEL}/versions/1"),
        http_exchange("v1 model status unknown model", "GET", "/v1/models/nope"),
        http_exchange("v1 metadata", "GET", f"/v1/models/{MODEL}/metadata"),
        http_exchange("v1 metadata version", "GET", f"/v1/models/{MODEL}/versions/2/metadata"),
        http_exchange("v1 metadata unknown model", "GET", "/v1/models/nope/metadata"),
        http_exchange("v1 predict rows", "POST", f"/v1/models/{MODEL}:predict",
                      _json({"instances": [RED_GREEN.tolist(), {"b64": b64(BLUE_PNG)}]}), JSON),
        http_exchange("v1 predict columns", "POST", f"/v1/models/{MODEL}/versions/2:predict",
                      _json({"signature_name": "serving_default", "inputs": [RED_GREEN.tolist()]}), JSON),
        http_exchange("v1 predict no instances", "POST", f"/v1/models/{MODEL}:predict", _json({"instances": []}),
                      JSON),
        http_exchange("v1 predict neither form", "POST", f"/v1/models/{MODEL}:predict", _json({"nothing": 1}), JSON),
        http_exchange("v1 predict bad base64", "POST", f"/v1/models/{MODEL}:predict",
                      _json({"instances": [{"b64": "!!!"}]}), JSON),
        http_exchange("v1 predict not json", "POST", f"/v1/models/{MODEL}:predict", b"[", JSON),
        http_exchange("v1 predict other signature", "POST", f"/v1/models/{MODEL}:predict",
                      _json({"signature_name": "other", "instances": [RED_GREEN.tolist()]}), JSON),
        http_exchange("v1 predict version not served", "POST", f"/v1/models/{MODEL}/versions/1:predict",
                      _json({"instances": [RED_GREEN.tolist()]}), JSON),
        http_exchange("v1 predict unknown model", "POST", "/v1/models/nope:predict",
                      _json({"instances": [RED_GREEN.tolist()]}), JSON),
        # The model repository: restricted to a header
        http_exchange("repository index without the header", "POST", "/v2/repository/index", b"{}", JSON),
        http_exchange("repository index with a wrong header", "POST", "/v2/repository/index", b"{}",
                      {**JSON, ADMIN_HEADER: "wrong"}),
        http_exchange("repository index", "POST", "/v2/repository/index", b"{}", {**JSON, **ADMIN}),
        http_exchange("repository index ready", "POST", "/v2/repository/index", _json({"ready": True}),
                      {**JSON, **ADMIN}),
        http_exchange("repository index not json", "POST", "/v2/repository/index", b"{", {**JSON, **ADMIN}),
        http_exchange("repository load without the header", "POST", f"/v2/repository/models/{MODEL}/load", b"",
                      JSON),
        http_exchange("repository load unknown model", "POST", "/v2/repository/models/nope/load", b"",
                      {**JSON, **ADMIN}),
        http_exchange("repository load with a config", "POST", f"/v2/repository/models/{MODEL}/load",
                      _json({"parameters": {"config": "{}"}}), {**JSON, **ADMIN}),
        http_exchange("repository load loaded model", "POST", f"/v2/repository/models/{MODEL}/load", b"",
                      {**JSON, **ADMIN}),
        http_exchange("repository unload without the header", "POST", f"/v2/repository/models/{MODEL}/unload", b"",
                      JSON),
        http_exchange("repository unload unknown model", "POST", "/v2/repository/models/nope/unload", b"",
                      {**JSON, **ADMIN}),
        http_exchange("repository unload", "POST", f"/v2/repository/models/{MODEL}/unload", b"", {**JSON, **ADMIN}),
        # While the model is unloaded by request (gRPC's RepositoryModelLoad loads it again)
        http_exchange("unloaded: detect", "POST", "/detect", PNG, {"Content-Type": "image/png"}),
        http_exchange("unloaded: v2 model ready", "GET", f"/v2/models/{MODEL}/ready"),
        http_exchange("unloaded: v2 infer", "POST", f"/v2/models/{MODEL}/infer", _json({"inputs": [_pixels(batch)]}),
                      JSON),
        http_exchange("unloaded: v1 model status", "GET", f"/v1/models/{MODEL}"),
        http_exchange("unloaded: repository index", "POST", "/v2/repository/index", b"", {**JSON, **ADMIN}),
        http_exchange("unloaded: readyz", "GET", "/readyz"),
    ]


def unimplemented_http_exchanges() -> list[dict]:
    """Each route of an extension the server lacks, by both methods: 400 naming the extension."""
    from app.http.v2 import UNIMPLEMENTED_EXTENSIONS

    return [http_exchange(f"extension {extension}: {method} {path}", method,
                          path.replace("<name>", MODEL).replace("<version>", "2").replace("<region>", "r"),
                          b"{}" if method == "POST" else None)
            for extension, paths in UNIMPLEMENTED_EXTENSIONS.items() for path in paths for method in ("GET", "POST")]


def _tensor(name="input_tensor", datatype="UINT8", shape=(1, 12, 16, 3), **extra) -> dict:
    return {"name": name, "datatype": datatype, "shape": list(shape), **extra}


def _infer(*inputs, raw=(), outputs=(), **fields) -> dict:
    request = {"model_name": MODEL, "inputs": list(inputs), **fields}
    if raw:
        request["raw_input_contents"] = [b64(data) for data in raw]
    if outputs:
        request["outputs"] = [{"name": name} for name in outputs]
    return request


def _tf_tensor(array: np.ndarray, dtype="DT_UINT8", field=None) -> dict:
    shape = {"dim": [{"size": str(d)} for d in array.shape]}
    if field is None:
        return {"dtype": dtype, "tensor_shape": shape, "tensor_content": b64(array.tobytes())}
    return {"dtype": dtype, "tensor_shape": shape, field: array.ravel().tolist()}


def _predict(tensor: dict, **fields) -> dict:
    spec = {"name": MODEL, **fields.pop("model_spec", {})}
    return {"model_spec": spec, "inputs": {"input_tensor": tensor}, **fields}


# Methods the servicers leave to grpc's generated base classes, called with an empty request: each answers
# UNIMPLEMENTED naming itself.
NOT_IMPLEMENTED = (
    KSERVE + "CudaSharedMemoryStatus", KSERVE + "CudaSharedMemoryRegister", KSERVE + "CudaSharedMemoryUnregister",
    KSERVE + "TraceSetting", KSERVE + "LogSettings",
    PREDICTION + "Classify", PREDICTION + "Regress", PREDICTION + "MultiInference",
)
# A POSIX shared-memory object the shared-memory exchanges register: made before the exchanges are sent.
SHM_KEY = "/gpu-share-detect-exchanges"
SHM_BYTES = 4096


def prepare_shared_memory() -> None:
    """Make the shared-memory object the exchanges name, zero-filled, as a client would with shm_open."""
    with open("/dev/shm" + SHM_KEY, "wb") as region:
        region.write(bytes(SHM_BYTES))


def grpc_exchanges() -> list[dict]:
    """Every gRPC method of every service on the port, with its success and main refusals, in the order sent."""
    pixels = RED_GREEN[None]
    raw = pixels.tobytes()
    typed = _tensor(shape=pixels.shape, contents={"uint_contents": pixels.ravel().tolist()})
    files = _tensor("image", "BYTES", (2,))
    files_raw = b"".join(len(f).to_bytes(4, "little") + f for f in (PNG, BLUE_PNG))
    admin = [(ADMIN_HEADER, ADMIN_KEY)]
    exchanges = [
        # KServe v2
        grpc_exchange("kserve live", KSERVE + "ServerLive", {}),
        grpc_exchange("kserve ready", KSERVE + "ServerReady", {}),
        grpc_exchange("kserve model ready", KSERVE + "ModelReady", {"name": MODEL}),
        grpc_exchange("kserve model ready version not served", KSERVE + "ModelReady", {"name": MODEL, "version": "1"}),
        grpc_exchange("kserve model ready unknown model", KSERVE + "ModelReady", {"name": "nope"}),
        grpc_exchange("kserve server metadata", KSERVE + "ServerMetadata", {}),
        grpc_exchange("kserve model metadata", KSERVE + "ModelMetadata", {"name": MODEL}),
        grpc_exchange("kserve model metadata version not served", KSERVE + "ModelMetadata",
                      {"name": MODEL, "version": "1"}),
        grpc_exchange("kserve model metadata unknown model", KSERVE + "ModelMetadata", {"name": "nope"}),
        grpc_exchange("kserve model config", KSERVE + "ModelConfig", {"name": MODEL, "version": "2"}),
        grpc_exchange("kserve model config unknown model", KSERVE + "ModelConfig", {"name": "nope"}),
        grpc_exchange("kserve infer raw pixels", KSERVE + "ModelInfer", _infer(_tensor(), raw=[raw], id="raw-1")),
        grpc_exchange("kserve infer typed pixels", KSERVE + "ModelInfer",
                      _infer(typed, outputs=("num_detections", "detection_classes"), model_version="2")),
        grpc_exchange("kserve infer files with detections", KSERVE + "ModelInfer",
                      _infer(files, raw=[files_raw], outputs=("detections", "num_detections"),
                             parameters={"threshold": {"double_param": 0.2}, "max_detections": {"int64_param": "2"}})),
        grpc_exchange("kserve infer typed files", KSERVE + "ModelInfer",
                      _infer(_tensor("image", "BYTES", (1,), contents={"bytes_contents": [b64(PNG)]}),
                             outputs=("detections",))),
        grpc_exchange("kserve infer no inputs", KSERVE + "ModelInfer", _infer()),
        grpc_exchange("kserve infer unknown datatype", KSERVE + "ModelInfer",
                      _infer(_tensor(datatype="UINT128"), raw=[raw])),
        grpc_exchange("kserve infer wrong datatype", KSERVE + "ModelInfer",
                      _infer(_tensor(datatype="INT32"), raw=[bytes(4 * pixels.size)])),
        grpc_exchange("kserve infer short raw contents", KSERVE + "ModelInfer", _infer(_tensor(), raw=[raw[:-1]])),
        grpc_exchange("kserve infer typed contents out of range", KSERVE + "ModelInfer",
                      _infer(_tensor(shape=(1, 1, 1, 3), contents={"uint_contents": [1, 2, 300]}))),
        grpc_exchange("kserve infer unknown input", KSERVE + "ModelInfer", _infer(_tensor("pixels"), raw=[raw])),
        grpc_exchange("kserve infer unknown output", KSERVE + "ModelInfer",
                      _infer(_tensor(), raw=[raw], outputs=("boxes",))),
        grpc_exchange("kserve infer bad parameter", KSERVE + "ModelInfer",
                      _infer(_tensor(), raw=[raw], parameters={"threshold": {"double_param": 2.0}})),
        grpc_exchange("kserve infer timeout past any float", KSERVE + "ModelInfer",
                      _infer(_tensor(), raw=[raw], parameters={"timeout": {"string_param": "9" * 320}})),
        grpc_exchange("kserve infer unknown parameter", KSERVE + "ModelInfer",
                      _infer(_tensor(), raw=[raw], parameters={"colour": {"string_param": "red"}})),
        grpc_exchange("kserve infer not an image", KSERVE + "ModelInfer",
                      _infer(_tensor("image", "BYTES", (1,)), raw=[b"\x03\x00\x00\x00abc"])),
        grpc_exchange("kserve infer version not served", KSERVE + "ModelInfer",
                      _infer(_tensor(), raw=[raw], model_version="1")),
        grpc_exchange("kserve infer unknown model", KSERVE + "ModelInfer",
                      {**_infer(_tensor(), raw=[raw]), "model_name": "nope"}),
        grpc_exchange("kserve infer message too large", KSERVE + "ModelInfer",
                      _infer(_tensor(shape=(1, 160, 160, 3)), raw=[b""]), pad=160 * 160 * 3),
        grpc_exchange("kserve stream infer", KSERVE + "ModelStreamInfer", [_infer(_tensor(), raw=[raw])]),
        # TF Serving
        grpc_exchange("tf predict tensor_content", PREDICTION + "Predict",
                      _predict(_tf_tensor(pixels), model_spec={"signature_name": "serving_default"})),
        grpc_exchange("tf predict int_val with a version", PREDICTION + "Predict",
                      _predict(_tf_tensor(pixels, field="int_val"), model_spec={"version": "2"})),
        grpc_exchange("tf predict encoded images with an output filter", PREDICTION + "Predict",
                      _predict({"dtype": "DT_STRING", "tensor_shape": {"dim": [{"size": "2"}]},
                                "string_val": [b64(PNG), b64(BLUE_PNG)]},
                               output_filter=["num_detections", "detection_classes"])),
        grpc_exchange("tf predict unknown model", PREDICTION + "Predict",
                      _predict(_tf_tensor(pixels), model_spec={"name": "nope"})),
        grpc_exchange("tf predict version not served", PREDICTION + "Predict",
                      _predict(_tf_tensor(pixels), model_spec={"version": "1"})),
        grpc_exchange("tf predict version label", PREDICTION + "Predict",
                      _predict(_tf_tensor(pixels), model_spec={"version_label": "stable"})),
        grpc_exchange("tf predict other signature", PREDICTION + "Predict",
                      _predict(_tf_tensor(pixels), model_spec={"signature_name": "other"})),
        grpc_exchange("tf predict unknown output", PREDICTION + "Predict",
                      _predict(_tf_tensor(pixels), output_filter=["boxes"])),
        grpc_exchange("tf predict unknown input", PREDICTION + "Predict",
                      {"model_spec": {"name": MODEL}, "inputs": {"pixels": _tf_tensor(pixels)}}),
        grpc_exchange("tf predict wrong dtype", PREDICTION + "Predict",
                      _predict(_tf_tensor(pixels.astype(np.int32), "DT_INT32"))),
        grpc_exchange("tf predict shape disagrees with data", PREDICTION + "Predict",
                      _predict({**_tf_tensor(pixels), "tensor_content": b64(raw[:-3])})),
        grpc_exchange("tf metadata", PREDICTION + "GetModelMetadata",
                      {"model_spec": {"name": MODEL}, "metadata_field": ["signature_def"]}),
        grpc_exchange("tf metadata bad field", PREDICTION + "GetModelMetadata",
                      {"model_spec": {"name": MODEL}, "metadata_field": ["other"]}),
        grpc_exchange("tf metadata unknown model", PREDICTION + "GetModelMetadata",
                      {"model_spec": {"name": "nope"}, "metadata_field": ["signature_def"]}),
        grpc_exchange("tf model status", MODEL_SERVICE + "GetModelStatus", {"model_spec": {"name": MODEL}}),
        grpc_exchange("tf model status version not served", MODEL_SERVICE + "GetModelStatus",
                      {"model_spec": {"name": MODEL, "version": "1"}}),
        grpc_exchange("tf model status unknown model", MODEL_SERVICE + "GetModelStatus",
                      {"model_spec": {"name": "nope"}}),
        grpc_exchange("tf reload config without the header", MODEL_SERVICE + "HandleReloadConfigRequest", {}),
        grpc_exchange("tf reload config", MODEL_SERVICE + "HandleReloadConfigRequest", {}, admin),
        # Health and reflection
        grpc_exchange("health server", HEALTH + "Check", {"service": ""}),
        grpc_exchange("health liveness", HEALTH + "Check", {"service": "liveness"}),
        grpc_exchange("health service", HEALTH + "Check", {"service": "tensorflow.serving.PredictionService"}),
        grpc_exchange("health model", HEALTH + "Check", {"service": MODEL}),
        grpc_exchange("health unknown", HEALTH + "Check", {"service": "nope"}),
        grpc_exchange("health list", HEALTH + "List", {}),
        grpc_exchange("health watch", HEALTH + "Watch", {"service": ""}, take=1),
        grpc_exchange("reflection", REFLECTION,
                      [{"list_services": ""}, {"file_containing_symbol": "nope.Nothing"}]),
        # Methods no service has
        grpc_exchange("unknown method", KSERVE + "NoSuchMethod", b""),
        grpc_exchange("unknown service", "/nope.Service/Method", b""),
    ]
    exchanges += [grpc_exchange(f"not implemented {m.rsplit('/', 1)[1]}", m, {}) for m in NOT_IMPLEMENTED]
    exchanges += [
        grpc_exchange("kserve statistics", KSERVE + "ModelStatistics", {"name": MODEL, "version": "2"}),
        grpc_exchange("kserve statistics unknown model", KSERVE + "ModelStatistics", {"name": "nope"}),
        grpc_exchange("kserve shm register", KSERVE + "SystemSharedMemoryRegister",
                      {"name": "g", "key": SHM_KEY, "byte_size": SHM_BYTES}),
        grpc_exchange("kserve shm register twice", KSERVE + "SystemSharedMemoryRegister",
                      {"name": "g", "key": SHM_KEY, "byte_size": SHM_BYTES}),
        grpc_exchange("kserve shm register no key", KSERVE + "SystemSharedMemoryRegister",
                      {"name": "h", "key": "/no-such-key", "byte_size": 8}),
        grpc_exchange("kserve shm register a name with a slash", KSERVE + "SystemSharedMemoryRegister",
                      {"name": "a/b", "key": SHM_KEY, "byte_size": SHM_BYTES}),
        grpc_exchange("kserve shm status", KSERVE + "SystemSharedMemoryStatus", {}),
        grpc_exchange("kserve shm unregister", KSERVE + "SystemSharedMemoryUnregister", {"name": "g"}),
        grpc_exchange("kserve shm unregister all", KSERVE + "SystemSharedMemoryUnregister", {}),
    ]
    # The repository: restricted to a header; the unload and load go last, around the HTTP ones while unloaded.
    exchanges += [
        grpc_exchange("kserve repository index without the header", KSERVE + "RepositoryIndex", {}),
        grpc_exchange("kserve repository index", KSERVE + "RepositoryIndex", {"ready": True}, admin),
        grpc_exchange("kserve repository load with a config", KSERVE + "RepositoryModelLoad",
                      {"model_name": MODEL, "parameters": {"config": {"string_param": "{}"}}}, admin),
        grpc_exchange("kserve repository load unknown model", KSERVE + "RepositoryModelLoad",
                      {"model_name": "nope"}, admin),
        grpc_exchange("kserve repository unload unknown model", KSERVE + "RepositoryModelUnload",
                      {"model_name": "nope"}, admin),
        grpc_exchange("kserve repository unload without the header", KSERVE + "RepositoryModelUnload",
                      {"model_name": MODEL}),
    ]
    return exchanges


def unloaded_grpc_exchanges() -> list[dict]:
    """Sent while the model is unloaded by request (after the HTTP unload); the last loads it again."""
    raw = RED_GREEN[None].tobytes()
    admin = [(ADMIN_HEADER, ADMIN_KEY)]
    return [
        grpc_exchange("unloaded: kserve model ready", KSERVE + "ModelReady", {"name": MODEL}),
        grpc_exchange("unloaded: kserve infer", KSERVE + "ModelInfer", _infer(_tensor(), raw=[raw])),
        grpc_exchange("unloaded: tf model status", MODEL_SERVICE + "GetModelStatus", {"model_spec": {"name": MODEL}}),
        grpc_exchange("unloaded: health model", HEALTH + "Check", {"service": MODEL}),
        grpc_exchange("unloaded: kserve repository unload again", KSERVE + "RepositoryModelUnload",
                      {"model_name": MODEL}, admin),
        grpc_exchange("kserve repository load", KSERVE + "RepositoryModelLoad", {"model_name": MODEL}, admin),
        grpc_exchange("loaded again: kserve infer", KSERVE + "ModelInfer", _infer(_tensor(), raw=[raw])),
    ]


def planned_exchanges() -> list[dict]:
    """All exchanges in the order they are sent: gRPC first, then HTTP (which unloads the model), then the rest."""
    return [*grpc_exchanges(), *http_exchanges(), *unloaded_grpc_exchanges(),
            http_exchange("loaded again: detect", "POST", "/detect", PNG, {"Content-Type": "image/png"}),
            http_exchange("metrics", "GET", "/metrics")]  # last: its series name every route and method called


# Running them ---------------------------------------------------------------------------------------------------


def build_models(folder: Path) -> Path:
    """The blob model's base path, versions 1 and 2 (2 served), under `folder`."""
    base = folder / MODEL
    build_blob_model(base / "1")
    build_blob_model(base / "2")
    return base


def answer(exchange: dict, http_port: int, grpc_port: GrpcPort, model_base: str) -> dict:
    """Send one recorded exchange; return its answer, normalized."""
    request = exchange["request"]
    if exchange["protocol"] == "http":
        return http_answer(*send_http(http_port, request), model_base)
    return send_grpc(grpc_port, request)


def record(path: Path = RECORDED) -> None:
    """Start a server on this code, send the planned exchanges, and write them with their answers to `path`."""
    from conftest import start_server

    with tempfile.TemporaryDirectory() as folder:
        base = build_models(Path(folder))
        server = start_server({"DETECT_MODEL": str(base), **SERVER_ENV}, Path(folder) / "server.log")
        port = GrpcPort(server.grpc_port)
        prepare_shared_memory()
        try:
            exchanges = planned_exchanges()
            for exchange in exchanges:
                if exchange["protocol"] == "grpc":
                    exchange["request"] = _written(port, exchange["request"])
                exchange["answer"] = answer(exchange, server.port, port, str(base))
        finally:
            port.close()
            server.stop()
    names = [e["name"] for e in exchanges]
    assert len(set(names)) == len(names), "exchange names must be unique"
    document = {"server_env": SERVER_ENV, "exchanges": exchanges}
    path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    print(f"recorded {len(exchanges)} exchanges to {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help=f"record anew to {RECORDED}")
    parser.add_argument("--out", type=Path, default=RECORDED, help="where to write the recording")
    args = parser.parse_args(argv)
    if not args.record:
        parser.error("say --record: it overwrites the recorded answers with this code's")
    started = time.monotonic()
    record(args.out)
    print(f"in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
