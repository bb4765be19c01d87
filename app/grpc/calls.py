"""What every gRPC call goes through around its servicer: its thread pool, the access rules, admission, its context,
one status table, metrics.

Triton's gRPC server applies its restricted-API check to a call's metadata before the handler runs and maps
every error to one status code; `CallInterceptor` does both for every service on the gRPC port. Servicers
raise the project's own errors (app.errors) and never abort a call themselves: the interceptor answers
each with its code from app.errors.GRPC_STATUS and its message (`status_of`, the one place an unexpected
error becomes INTERNAL). Each call runs in a request context of its own (app/protocol/context.py), as an
HTTP request does, over the same data plane (app/protocol/plane.py).

Threads, so that no caller can take what a probe needs (app/protocol/admission.py): the interceptor gives
each call its pool (gRPC's `experimental_thread_pool` on the handler, chosen before the call is queued):
probes (health Check and List, ServerLive, ServerReady, ModelReady) and Watch's set-up run on a pool of
their own; each kind of call held open (an inference stream, a reflection stream) on one sized to its cap,
with room to refuse the one past it at once; every other call on the main pool. A call held open is
admitted against its kind's cap and ended when idle (`HeldRequests`, and `_watching` for Watch, which holds
no thread at all while it waits).

The interceptor runs in gRPC's serving thread; everything else here in the pools' threads. Thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Optional
from urllib.parse import unquote

import grpc

from ..access import (
    HEALTH, INFERENCE, LOGGING, METADATA, MODEL_CONFIG, MODEL_REPOSITORY, SHARED_MEMORY, STATISTICS, TRACE,
    group_refusal,
)
from ..errors import CallIdle, RequestError, Unimplemented, grpc_status
from ..protocol import context as request_context
from ..protocol.admission import REFLECTION, STREAM, WATCH, Admission, Ticket
from ..protocol.context import Client
from ..protocol.plane import DataPlane
from ..timeline import Timeline

log = logging.getLogger(__name__)

KSERVE = "/inference.GRPCInferenceService/"
TF_PREDICTION = "/tensorflow.serving.PredictionService/"
TF_MODEL = "/tensorflow.serving.ModelService/"
HEALTH_SERVICE = "/grpc.health.v1.Health/"
REFLECTION_METHOD = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"

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
# The probes: they answer from the server's own state and never wait on a model, so a pool of a few threads
# serves them all.
PROBE_METHODS = frozenset({KSERVE + "ServerLive", KSERVE + "ServerReady", KSERVE + "ModelReady",
                           HEALTH_SERVICE + "Check", HEALTH_SERVICE + "List"})
# The calls a client holds open, by their kind in app/protocol/admission.py.
HELD_METHODS = {KSERVE + "ModelStreamInfer": STREAM, HEALTH_SERVICE + "Watch": WATCH, REFLECTION_METHOD: REFLECTION}

CONTROL_THREADS = 4  # metadata, configuration and statistics beside a full complement of inference calls
PROBE_THREADS = 4
REFUSAL_THREADS = 2  # a held kind's pool holds its cap and these, to refuse the one past the cap at once


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


def status_of(error: BaseException, where: str) -> tuple[str, str]:
    """The status code's name and the message to answer `error` with: its own for the project's errors
    (app.errors.GRPC_STATUS); INTERNAL for anything else, its cause logged and never sent."""
    if isinstance(error, RequestError):
        return grpc_status(error), error.message
    log.error("unexpected error in %s", where, exc_info=error)
    return "INTERNAL", "an internal error occurred; it has been logged"


class Pools:
    """The gRPC server's thread pools: the main one, the probes', and one per kind of call held on a thread."""

    def __init__(self, settings, caps: dict[str, int]):
        self.main = ThreadPoolExecutor(settings.http_threads + CONTROL_THREADS, thread_name_prefix="grpc")
        self.probes = ThreadPoolExecutor(PROBE_THREADS, thread_name_prefix="grpc-probe")
        self._held = {kind: ThreadPoolExecutor(caps[kind] + REFUSAL_THREADS, thread_name_prefix=f"grpc-{kind}")
                      for kind in (STREAM, REFLECTION)}

    def for_method(self, method: str) -> Optional[ThreadPoolExecutor]:
        """The pool a call of `method` runs on; None: the main one (the server's own)."""
        if method in PROBE_METHODS or HELD_METHODS.get(method) == WATCH:  # a Watch's set-up is as quick as a Check
            return self.probes
        return self._held.get(HELD_METHODS.get(method, ""))

    def shutdown(self) -> None:
        for pool in (self.probes, *self._held.values()):
            pool.shutdown(wait=False, cancel_futures=True)


class CallInterceptor(grpc.ServerInterceptor):
    """Give each call its pool, check access, admit held calls, run each call in a request context, answer errors
    from GRPC_STATUS, and count every unary call."""

    def __init__(self, plane: DataPlane, admission: Admission, pools: Pools):
        self._plane = plane
        self._restrictions = plane.restrictions
        self._metrics = plane.metrics
        self._admission = admission
        self._pools = pools

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # grpc answers UNIMPLEMENTED
        method = handler_call_details.method
        # Binary (-bin) metadata never carries a restricted-API header; grpc lowercases every key.
        headers = {key.lower(): value for key, value in handler_call_details.invocation_metadata or ()
                   if isinstance(value, str)}
        group = method_group(method)
        kind = HELD_METHODS.get(method)
        if handler.unary_unary is not None:
            field, wrapped = "unary_unary", self._unary(handler.unary_unary, method, group, headers)
        elif handler.unary_stream is not None and getattr(handler.unary_stream, "experimental_non_blocking", False):
            field, wrapped = "unary_stream", self._watching(handler.unary_stream, method, group, headers, kind)
        elif handler.unary_stream is not None:
            field, wrapped = "unary_stream", self._streaming(handler.unary_stream, method, group, headers, kind,
                                                             streamed_requests=False)
        elif handler.stream_stream is not None:
            field, wrapped = "stream_stream", self._streaming(handler.stream_stream, method, group, headers, kind,
                                                              streamed_requests=True)
        else:
            return handler
        pool = self._pools.for_method(method)
        if pool is not None:
            wrapped.experimental_thread_pool = pool
        return handler._replace(**{field: wrapped})

    def _client(self, headers: dict, context) -> Client:
        return Client(peer_host(context.peer()), headers)

    def _check_access(self, group: str, client: Client) -> None:
        refused = group_refusal(group, client.headers, client.address, self._restrictions)
        if refused is not None:
            raise refused

    def _unary(self, behaviour, method: str, group: str, headers: dict):
        def guarded(request, context):
            started = time.perf_counter()
            code, message = "OK", ""
            client = self._client(headers, context)
            token = request_context.begin(Timeline(), client)
            # Termination by the client (a cancel, a dropped connection) drops what the call has queued.
            context.add_callback(request_context.current().cancellation.cancel)
            try:
                self._check_access(group, client)
                answer = behaviour(request, context)
                observe_request(self._plane, answered=True)
                return answer
            except Exception as error:
                code, message = status_of(error, method)
            finally:
                model = request_context.model_name()
                if code != "OK":
                    observe_request(self._plane, answered=False)
                request_context.end(token)
                self._metrics.observe_call(method, code, time.perf_counter() - started, model)
            context.abort(grpc.StatusCode[code], message)

        return guarded

    def _streaming(self, behaviour, method: str, group: str, headers: dict, kind: Optional[str],
                   streamed_requests: bool):
        """A streaming call: access, and for a kind held open its admission and, for a stream of requests, its idle
        end (HeldRequests)."""
        def guarded(request, context):
            ticket = held = None
            client = self._client(headers, context)
            # The stream's own context, which each of its requests shares (app/grpc/streams.py): its client, and
            # its cancellation, which the stream's end sets.
            token = request_context.begin(Timeline(), client)
            context.add_callback(request_context.current().cancellation.cancel)
            try:
                self._check_access(group, client)
                if kind is not None:
                    ticket = self._admission.enter(kind)
                if ticket is not None and streamed_requests:
                    request = held = HeldRequests(request, ticket, context)
                for answer in behaviour(request, context):
                    if held is not None:
                        held.answered()
                    yield answer
                return
            except grpc.RpcError:  # the client cancelled, or went away, while its stream was read: no one to answer
                return
            except Exception as error:
                code, message = status_of(error, method)
            finally:
                if held is not None:
                    held.close()
                if ticket is not None:
                    ticket.leave()
                with suppress(ValueError):  # a generator closed by the garbage collector runs this elsewhere
                    request_context.end(token)
            context.abort(grpc.StatusCode[code], message)

        return guarded

    def _watching(self, behaviour, method: str, group: str, headers: dict, kind: Optional[str]):
        """A call that answers through a callback and holds no thread while it waits (health Watch): access and
        admission now, its place given back when it ends, and an idle one ended."""
        def guarded(request, context, send_response_callback):
            try:
                self._check_access(group, self._client(headers, context))
                ticket = self._admission.enter(kind) if kind is not None else None
            except Exception as error:
                code, message = status_of(error, method)
                context.set_code(grpc.StatusCode[code])
                context.set_details(message)
                send_response_callback(None)
                return
            if ticket is None:
                behaviour(request, context, send_response_callback)
                return

            def send(response):
                ticket.moved()
                send_response_callback(response)

            ticket.on_idle = lambda: end_idle(context, ticket, send)
            context.add_callback(ticket.leave)
            behaviour(request, context, send)

        guarded.experimental_non_blocking = True
        return guarded


def end_idle(context, ticket: Ticket, send) -> None:
    """End a held call idle for idle_timeout_s with UNAVAILABLE saying so (its client opens a new one)."""
    idle = CallIdle(f"the {ticket.kind} call moved no message for {ticket.admission.idle_timeout_s:g} s "
                    "(idle_timeout_s) and was ended; open a new one")
    context.set_code(grpc.StatusCode[grpc_status(idle)])
    context.set_details(idle.message)
    send(None)


class HeldRequests:
    """The requests of a stream held open, read in a thread of their own, so that the call can end once idle.

    The call's thread iterates this instead of gRPC's request iterator. A request read counts the call busy
    until its answer goes out (`answered`), and a busy call is never idle. When the admission's watchdog finds
    it idle (on_idle), the call's status is set to UNAVAILABLE and iteration stops, as if the client had
    finished: the handler ends, and gRPC ends the call. The reader thread ends with the call.
    """

    _END = object()
    _IDLE = object()

    def __init__(self, requests, ticket: Ticket, context):
        self._requests = requests
        self._ticket = ticket
        self._context = context
        self._queue: queue.Queue = queue.Queue(maxsize=1)  # gRPC's flow control keeps the rest with the client
        self._closed = threading.Event()
        self._busy_lock = threading.Lock()
        ticket.on_idle = self._idle
        threading.Thread(target=self._read, name="grpc-held-reader", daemon=True).start()

    def __iter__(self):
        return self

    def __next__(self):
        item = self._queue.get()
        if item is self._END or item is self._IDLE:
            raise StopIteration
        if isinstance(item, Exception):
            raise item
        return item

    def answered(self) -> None:
        """An answer went out: the call is busy with one request less."""
        self._add_busy(-1)

    def close(self) -> None:
        self._closed.set()

    def _add_busy(self, change: int) -> None:
        with self._busy_lock:
            self._ticket.busy += change
        self._ticket.moved()

    def _read(self) -> None:
        try:
            for request in self._requests:
                self._add_busy(1)
                if not self._offer(request):
                    return
        except Exception as exc:  # the client cancelled, or the connection broke: the handler learns of it
            self._offer(exc)
            return
        self._offer(self._END)

    def _offer(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _idle(self) -> None:
        end_idle(self._context, self._ticket, lambda _: None)
        try:
            self._queue.put_nowait(self._IDLE)  # idle means nothing was waiting: the queue is empty
        except queue.Full:
            pass


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


def deadline_of(context, limit_s: float) -> float:
    """The call's deadline (time.monotonic()): `limit_s` from now, or the client's deadline if that is sooner."""
    remaining = context.time_remaining()
    if remaining is not None:
        limit_s = min(limit_s, max(remaining, 0.0))
    return time.monotonic() + limit_s
