"""Prometheus metrics of one server, on a registry of its own (no process globals).

Request, queue, batch and inference series carry a `model` label ("" for routes without a model);
per-model gauges (loaded, worker memory, cap, queue depth) are read from the model registry at scrape
time, and GPU gauges from NVML.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .errors import NvmlUnavailable
from .statistics import InferenceStatistics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
LOAD_BUCKETS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0)
# A stage can take 20 microseconds (a thread hand-off) or seconds (a queue under load).
STAGE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 10.0)
MIB = 2**20

# The *_created series double every counter's output and no dashboard here reads them.
disable_created_metrics()


class ServiceMetrics:
    """The server's counters and histograms; thread-safe (prometheus-client locks internally)."""

    def __init__(self, gpu_report=None):
        self.statistics = InferenceStatistics()  # Triton's statistics extension, from the same observations
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("detect_http_requests", "HTTP requests by route, status and model.",
                                ("route", "status", "model"), registry=r)
        self.request_latency = Histogram(
            "detect_http_request_duration_seconds", "Whole request latency in the app, by route and model.",
            ("route", "model"), buckets=LATENCY_BUCKETS, registry=r)
        self.inference_latency = Histogram("detect_inference_duration_seconds", "Latency of one model call.",
                                           ("model",), buckets=LATENCY_BUCKETS, registry=r)
        self.images_per_call = Histogram("detect_images_per_model_call", "Images in one model call (the batch size).",
                                         ("model",), buckets=BATCH_BUCKETS, registry=r)
        self.images = Counter("detect_images", "Images run through the model.", ("model",), registry=r)
        self.queue_wait = Histogram("detect_queue_wait_seconds", "Time an image waited in the queue before its call.",
                                    ("model",), buckets=LATENCY_BUCKETS, registry=r)
        self.stage_latency = Histogram(
            "detect_request_stage_seconds", "Time an inference request spent in each stage (app/timeline.py), by "
            "model and stage.", ("model", "stage"), buckets=STAGE_BUCKETS, registry=r)
        self.out_of_memory = Counter("detect_out_of_memory", "Images that ran out of memory alone under the cap.",
                                     ("model",), registry=r)
        self.dropped_images = Counter(
            "detect_dropped_images", "Images taken out of the queue before their model call because their client "
            "went away (an HTTP connection closed, a gRPC call cancelled).", ("model",), registry=r)
        # What each door has admitted (app/protocol/admission.py): open now, and held calls ended for idleness.
        self.open_calls = Gauge("detect_open_calls", "Calls admitted and not yet ended, by door (http, grpc) and kind "
                                "(inference; and the calls a client holds open: stream, watch, reflection).",
                                ("door", "kind"), registry=r)
        self.idle_calls_ended = Counter("detect_idle_calls_ended", "Held calls ended after idle_timeout_s without a "
                                        "message either way, by door and kind.", ("door", "kind"), registry=r)
        # gRPC calls, by their full method name (/inference.GRPCInferenceService/ModelInfer) and status code name.
        self.grpc_requests = Counter("detect_grpc_requests", "gRPC calls by method, status code and model.",
                                     ("method", "code", "model"), registry=r)
        self.grpc_latency = Histogram(
            "detect_grpc_request_duration_seconds", "Whole gRPC call latency in the server, by method and model.",
            ("method", "model"), buckets=LATENCY_BUCKETS, registry=r)
        self.grpc_in_flight = Gauge("detect_grpc_inference_calls_in_flight",
                                    "gRPC inference calls admitted and not yet answered.", registry=r)
        self.in_flight = Gauge("detect_http_requests_in_flight", "Requests received and not yet answered.",
                               registry=r)
        self.model_loads = Counter("detect_model_loads", "Model versions loaded into a worker.", ("model",), registry=r)
        self.model_load_failures = Counter("detect_model_load_failures", "Loads that failed.", ("model",), registry=r)
        self.model_unloads = Counter("detect_model_unloads", "Workers ended, by reason: idle, evicted, replaced, "
                                     "requested.", ("model", "reason"), registry=r)
        self.worker_restarts = Counter("detect_worker_restarts", "Unexpected worker exits, each followed by a restart "
                                       "or a give-up.", ("model",), registry=r)
        self.model_load_seconds = Histogram("detect_model_load_seconds", "From the budget had for a load to ready "
                                            "(a wait for room is not counted).", ("model",), buckets=LOAD_BUCKETS,
                                            registry=r)
        # Video (POST /detect/video): frames run through the model, and each video's end.
        self.video_frames = Counter("detect_video_frames", "Video frames decoded and sent to the model.", ("model",),
                                    registry=r)
        self.videos = Counter("detect_videos", "Videos answered, by how they ended: complete, error (an error line "
                              "or a cut MP4) or gone (the client went away).", ("model", "outcome"), registry=r)
        if gpu_report is not None:
            r.register(_GpuMemoryCollector(gpu_report))

    def observe_model_call(self, model: str, images: int, seconds: float) -> None:
        """Record one model call, as its worker timed it."""
        self.inference_latency.labels(model=model).observe(seconds)
        self.images_per_call.labels(model=model).observe(images)
        self.images.labels(model=model).inc(images)
        self.statistics.observe_execution(model, images, seconds)

    def observe_stages(self, model: str, timeline) -> None:
        """Record where one inference request's time went (an app.timeline.Timeline)."""
        for stage, seconds in timeline.seconds.items():
            self.stage_latency.labels(model=model, stage=stage).observe(seconds)

    def observe_load(self, model: str, seconds: float) -> None:
        self.model_loads.labels(model=model).inc()
        self.model_load_seconds.labels(model=model).observe(seconds)

    def watch_in_flight(self, count) -> None:
        """Report the requests in flight, `count()`, at scrape time."""
        self.in_flight.set_function(count)

    def watch_grpc_in_flight(self, count) -> None:
        """Report the gRPC inference calls in flight, `count()`, at scrape time."""
        self.grpc_in_flight.set_function(count)

    def watch_open_calls(self, admission, kinds) -> None:
        """Report a door's open calls of each of `kinds` from its Admission (app/protocol/admission.py) at scrape
        time, and count its idle endings."""
        for kind in kinds:
            self.open_calls.labels(door=admission.door, kind=kind).set_function(
                lambda kind=kind: admission.open_calls(kind))

    def observe_idle_end(self, door: str, kind: str) -> None:
        self.idle_calls_ended.labels(door=door, kind=kind).inc()

    def watch_models(self, models) -> None:
        """Report each model's state, worker memory, cap and queue depth from the registry at scrape time."""
        self.registry.register(_ModelCollector(models))

    def observe_request(self, route: str, status: int, seconds: float, model: str = "") -> None:
        self.requests.labels(route=route, status=str(status), model=model).inc()
        self.request_latency.labels(route=route, model=model).observe(seconds)

    def observe_call(self, method: str, code: str, seconds: float, model: str = "") -> None:
        """Record one gRPC call: its method, its status code's name (OK, INVALID_ARGUMENT...), its duration."""
        self.grpc_requests.labels(method=method, code=code, model=model).inc()
        self.grpc_latency.labels(method=method, model=model).observe(seconds)

    def observe_refusal(self, route: str, status: int, model: str = "") -> None:
        """Count a request refused before it reached the app (overload, shutdown)."""
        self.requests.labels(route=route, status=str(status), model=model).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """What one model records: its calls, loads, load failures, unloads and restarts; nothing without metrics."""

    def __init__(self, metrics: Optional[ServiceMetrics], model: str):
        self._metrics = metrics
        self._model = model
        # The queue's hook for each image's wait before its call; None: the queue times nothing.
        self.queue_wait = metrics.queue_wait.labels(model=model).observe if metrics is not None else None

    def call(self, images: int, seconds: float, out_of_memory: int) -> None:
        """Record one model call, as its worker timed it, and the images that ran out of memory alone."""
        if self._metrics is not None:
            self._metrics.observe_model_call(self._model, images, seconds)
            if out_of_memory:
                self._metrics.out_of_memory.labels(model=self._model).inc(out_of_memory)

    def loaded(self, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.observe_load(self._model, seconds)

    def load_failed(self) -> None:
        if self._metrics is not None:
            self._metrics.model_load_failures.labels(model=self._model).inc()

    def unloaded(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.model_unloads.labels(model=self._model, reason=reason).inc()

    def restarted(self) -> None:
        if self._metrics is not None:
            self._metrics.worker_restarts.labels(model=self._model).inc()

    def dropped(self, images: int) -> None:
        """Count images dropped from the queue because their client went away."""
        if self._metrics is not None:
            self._metrics.dropped_images.labels(model=self._model).inc(images)


class _ModelCollector:
    """Per-model gauges, read from the model registry at scrape time."""

    def __init__(self, models):
        self._models = models

    def describe(self):
        return []

    def collect(self):
        loaded = GaugeMetricFamily("detect_model_loaded", "1 while a worker serves the model.", labels=("model",))
        depth = GaugeMetricFamily("detect_queue_depth", "Images waiting for a model call.", labels=("model",))
        memory = GaugeMetricFamily("detect_model_memory_bytes", "What the model's worker holds: GPU memory (NVML) "
                                   "or, without a GPU, resident host memory.", labels=("model", "source"))
        cap = GaugeMetricFamily("detect_model_memory_cap_bytes", "The worker's GPU memory cap, over its GPUs.",
                                labels=("model",))
        tensorflow = GaugeMetricFamily("detect_model_tensorflow_memory_bytes", "GPU memory TensorFlow's allocator "
                                       "uses in the model's worker.", labels=("model",))
        execution = GaugeMetricFamily("detect_model_precision_info", "1 for the precision the model's loaded "
                                      "version computes at, with the parity gate's word (passed, failed, skipped, "
                                      "none).", labels=("model", "version", "precision", "asked", "gate"))
        group = GaugeMetricFamily("detect_model_worker_group_info", "1 for each model of a worker group, with the "
                                  "group and the pid of its one worker ('' while none runs).",
                                  labels=("model", "group", "pid"))
        for row in self._models.describe():
            name = row["name"]
            if row.get("worker_group"):
                group.add_metric((name, row["worker_group"], str(row["pid"] or "")), 1.0)
            executes = row.get("execution")
            if executes and row["pid"]:
                execution.add_metric((name, str(row["version"]), executes["precision"], executes["asked"],
                                      executes["gate"]), 1.0)
            loaded.add_metric((name,), 1.0 if row["state"] in ("ready", "unloading") and row["pid"] else 0.0)
            depth.add_metric((name,), row["queue_depth"])
            caps = [c for c in row["caps_mib"].values() if c is not None]
            if caps:
                cap.add_metric((name,), sum(caps) * MIB)
            held = row.get("memory")
            if held and held.get("used_mib") is not None:
                memory.add_metric((name, held["source"]), held["used_mib"] * MIB)
            used = [g.get("current_mib") for g in held.get("tensorflow", [])] if held else []
            if used and all(u is not None for u in used):
                tensorflow.add_metric((name,), sum(used) * MIB)
        yield from (loaded, depth, memory, cap, tensorflow, execution, group)


class _GpuMemoryCollector:
    """Read GPU memory from NVML at scrape time; yields nothing where NVML is unavailable."""

    def __init__(self, gpu_report):
        self._gpu_report = gpu_report

    def describe(self):
        return []

    def collect(self):
        try:
            devices = self._gpu_report.devices()
        except NvmlUnavailable:
            return
        used = GaugeMetricFamily("detect_gpu_memory_used_bytes", "GPU memory in use, per GPU (NVML).",
                                 labels=("gpu", "uuid"))
        total = GaugeMetricFamily("detect_gpu_memory_total_bytes", "GPU memory in all, per GPU (NVML).",
                                  labels=("gpu", "uuid"))
        for d in devices:
            used.add_metric((str(d.index), d.uuid), d.memory_used_mib * 2**20)
            total.add_metric((str(d.index), d.uuid), d.memory_total_mib * 2**20)
        yield used
        yield total
