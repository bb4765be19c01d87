"""What every gRPC call goes through around its servicer: the access rules, its context, one status table, metrics.

Triton's gRPC server applies its restricted-API check to a call's metadata before the handler runs and maps
every error to one status code; `CallInterceptor` does both for every service on the gRPC port. Servicers
raise the project's own errors (app.errors) and never abort a call themselves: the interceptor answers
each with its code from app.errors.GRPC_STATUS and its message. Each call runs in a request context of its
own (app/protocol/context.py), as an HTTP request does, over the same data plane (app/protocol/plane.py).

Called in the gRPC server's worker threads; everything here is thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Optional
from urllib.parse import unquote

import grpc

from ..access import (
    HEALTH, INFERENCE, LOGGING, METADATA, MODEL_CONFIG, MODEL_REPOSITORY, SHARED_MEMORY, STATISTICS, TRACE,
    group_refusal,
)
from ..errors import NotReady, Overloaded, RequestError, Unimplemented, grpc_status
from ..protocol import context as request_context
from ..protocol.plane import DataPlane
from ..timeline import Timeline

log = logging.getLogger(__name__)

KSERVE = "/inference.GRPCInferenceService/"
TF_PREDICTION = "/tensorflow.serving.PredictionService/"
TF_MODEL = "/tensorflow.serving.ModelService/"
HEALTH_SERVICE = "/grpc.health.v1.Health/"

# Each method's restricted-API group, as Triton groups its gRPC methods; a method not listed is metadata.
METHOD_GROUPS = {
    **{KSERVE + m: INFERENCE for m in ("ModelInfer", "ModelStreamInfer")},
    **{TF_PREDICTION + m: INFERENCE for m in ("Predict", "Classify", "Regress", "MultiInference")},
    **{KSERVE + m: HEALTH for m in ("ServerLive", "ServerReady", "ModelReady")},
    **{HEALTH_SERVICE + m: HEALTH for m in ("Check", "Watch", "List")},
    **{KSERVE + m: MODEL_REPOSITORY for m in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")},
    TF_MODEL + "HandleReloadConfigRequest": MODEL_REPOSITORY,
    KSERVE + "ModelStatistics": STATISTICS,
    **{KSERVE + f"{kind}SharedMemory{verb}": SHARED_MEMORY
       for kind in ("System", "Cuda") for verb in ("Status", "Register", "Unregister")},
    KSERVE + "ModelConfig": MODEL_CONFIG,
    KSERVE + "TraceSetting": TRACE,
    KSERVE + "LogSettings": LOGGING,
}


def method_group(method: str) -> str:
    """Return the restricted-API group of a full gRPC method name."""
    return METHOD_GROUPS.get(method, METADATA)


def peer_host(peer: str) -> Optional[str]:
    """The address of a gRPC peer string (ipv4:127.0.0.1:5000, ipv6:[::1]:5000, which grpc may send
    percent-encoded as ipv6:%5B::1%5D:5000), or None (unix sockets)."""
    kind, _, rest = unquote(peer).partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return None


class CallInterceptor(grpc.ServerInterceptor):
    """Check access, run each call in a request context, answer errors from GRPC_STATUS, and count every call."""

    def __init__(self, plane: DataPlane):
        self._plane = plane
        self._restrictions = plane.restrictions
        self._metrics = plane.metrics

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # grpc answers UNIMPLEMENTED
        method = handler_call_details.method
        # Binary (-bin) metadata never carries a restricted-API header; grpc lowercases every key.
        headers = {key.lower(): value for key, value in handler_call_details.invocation_metadata or ()
                   if isinstance(value, str)}
        group = method_group(method)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, method, group, headers))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._streaming(handler.unary_stream, group, headers))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=self._streaming(handler.stream_stream, group, headers))
        return handler

    def _refusal(self, group: str, headers: dict, context) -> Optional[RequestError]:
        return group_refusal(group, headers, peer_host(context.peer()), self._restrictions)

    def _unary(self, behaviour, method: str, group: str, headers: dict):
        def guarded(request, context):
            started = time.perf_counter()
            code, message = "OK", ""
            token = request_context.begin(Timeline())
            try:
                refused = self._refusal(group, headers, context)
                if refused is not None:
                    raise refused
                answer = behaviour(request, context)
                observe_request(self._plane, answered=True)
                return answer
            except RequestError as error:
                code, message = grpc_status(error), error.message
            except Exception:
                log.exception("unexpected error in %s", method)
                code, message = "INTERNAL", "an internal error occurred; it has been logged"
            finally:
                model = request_context.model_name()
                if code != "OK":
                    observe_request(self._plane, answered=False)
                request_context.end(token)
                self._metrics.observe_call(method, code, time.perf_counter() - started, model)
            context.abort(grpc.StatusCode[code], message)

        return guarded

    def _streaming(self, behaviour, group: str, headers: dict):
        def guarded(request, context):
            try:
                refused = self._refusal(group, headers, context)
                if refused is not None:
                    raise refused
                yield from behaviour(request, context)
                return
            except RequestError as error:
                code, message = grpc_status(error), error.message
            except grpc.RpcError:  # the client cancelled, or went away, while its stream was read: no one to answer
                return
            except Exception:
                log.exception("unexpected error in a streaming call")
                code, message = "INTERNAL", "an internal error occurred; it has been logged"
            context.abort(grpc.StatusCode[code], message)

        return guarded


def answer_unimplemented(servicer, base: type, service: str):
    """Make each method of the generated `base` that `servicer` does not override answer UNIMPLEMENTED naming
    it (the generated one raises NotImplementedError, which would read as an internal error); return servicer."""
    for name, member in vars(base).items():
        if callable(member) and not name.startswith("_") and getattr(type(servicer), name) is member:
            setattr(servicer, name, _unimplemented(f"{service}/{name}"))
    return servicer


def _unimplemented(method: str):
    def refuse(request, context):
        raise Unimplemented(f"{method} is not implemented by this server")

    return refuse


def observe_request(plane: DataPlane, answered: bool) -> None:
    """Record the current call's stages and statistics once it is answered or has failed (a unary call, or one
    request of a stream); a call that ran images records where the time went."""
    timeline = request_context.timeline()
    if answered and "decode" in timeline.seconds:
        timeline.lap("encode")
        plane.metrics.observe_stages(request_context.model_name(), timeline)
    plane.observe_statistics(answered)


class Admission:
    """Inference calls admitted at once over gRPC: at most `limit` (http_threads), as the HTTP site admits them.

    None is admitted while the server drains, nor while its model's queue is full: those are refused at once
    (UNAVAILABLE, RESOURCE_EXHAUSTED), so overload never piles calls up behind the queue. Thread-safe.
    """

    def __init__(self, limit: int, lifecycle):
        self._limit = limit
        self._lifecycle = lifecycle
        self._lock = threading.Lock()
        self.in_flight = 0

    @contextmanager
    def admit(self, model):
        with self._lock:
            if self._lifecycle is not None and self._lifecycle.draining:
                raise NotReady("the server is shutting down; retry on another instance")
            if self.in_flight >= self._limit:
                raise Overloaded(f"the server is handling {self.in_flight} gRPC inference calls, its limit "
                                 "(http_threads); retry shortly")
            refusal = model.queue.refusal()
            if refusal is not None:
                raise refusal
            self.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1


class Streams:
    """The requests of bidirectional streams (ModelStreamInfer), run at once on a pool of their own.

    At most `limit` requests (http_threads) are read ahead of their answers across every stream together: a
    stream's reader waits for room before it reads the next, so a client that floods its streams is slowed by
    gRPC's flow control, never buffered here. At most `max_streams` streams are open at once, since each holds
    one of the gRPC server's threads for its whole life; one more is refused at once (RESOURCE_EXHAUSTED), so
    idle streams can never take the threads unary calls and health checks need. The model's work inside each
    request still passes Admission, as a unary call's does. Thread-safe.
    """

    _READ_ALL = object()  # the reader's last word: every request of the stream has been handed out

    def __init__(self, limit: int, max_streams: int):
        self._room = threading.Semaphore(limit)
        self._max_streams = max_streams
        self._lock = threading.Lock()
        self.open = 0
        self._pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="grpc-stream")

    def serve(self, requests, context, answer):
        """Yield `answer(request, context)` for each request of the stream as it finishes, until the client has
        sent its last request and every answer is out, or until the client goes away. `answer` never raises: it
        answers a failed request with its error (app/grpc/kserve.py)."""
        with self._lock:
            if self.open >= self._max_streams:
                raise Overloaded(f"{self.open} streams are open, the most this server holds (half of http_threads); "
                                 "send on an open stream, or retry shortly")
            self.open += 1
        answers: queue.SimpleQueue = queue.SimpleQueue()
        gone = threading.Event()
        closed = threading.Event()

        def close():  # once, whichever comes first: the call's end, or the last answer sent
            with self._lock:
                if not closed.is_set():
                    closed.set()
                    self.open -= 1

        context.add_callback(lambda: (gone.set(), answers.put(self._READ_ALL), close()))

        def run(request):
            try:
                answers.put(answer(request, context))
            finally:
                self._room.release()

        def read():
            count = 0
            try:
                for request in requests:
                    while not self._room.acquire(timeout=0.5):
                        if gone.is_set():
                            return
                    if gone.is_set():
                        self._room.release()
                        return
                    try:
                        self._pool.submit(run, request)
                    except RuntimeError:  # the pool has shut down: the server is stopping
                        self._room.release()
                        return
                    count += 1
            except Exception as exc:  # the client cancelled, or the connection broke, while we read
                log.debug("a stream ended while reading: %s", exc)
            finally:
                answers.put((self._READ_ALL, count))

        threading.Thread(target=read, name="grpc-stream-reader", daemon=True).start()
        try:
            sent, total = 0, None
            while total is None or sent < total:
                item = answers.get()
                if gone.is_set():
                    return
                if isinstance(item, tuple) and item and item[0] is self._READ_ALL:
                    total = item[1]
                    continue
                yield item
                sent += 1
        finally:
            close()

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def deadline_of(context, limit_s: float) -> float:
    """The call's deadline (time.monotonic()): `limit_s` from now, or the client's deadline if that is sooner."""
    remaining = context.time_remaining()
    if remaining is not None:
        limit_s = min(limit_s, max(remaining, 0.0))
    return time.monotonic() + limit_s
