"""Prometheus metrics of one service instance, on a registry of its own (no process globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .errors import NvmlUnavailable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

# The *_created series double every counter's output and no dashboard here reads them.
disable_created_metrics()


class ServiceMetrics:
    """The instance's counters and histograms; thread-safe (prometheus-client locks internally)."""

    def __init__(self, gpu_report=None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "detect_http_requests", "HTTP requests by route and status.", ("route", "status"),
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "detect_http_request_duration_seconds", "Whole request latency in the app, by route.", ("route",),
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.inference_latency = Histogram(
            "detect_inference_duration_seconds", "Latency of one model call.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.images_per_call = Histogram(
            "detect_images_per_model_call", "Images in one model call (the batch size).",
            buckets=BATCH_BUCKETS, registry=self.registry,
        )
        self.images = Counter("detect_images", "Images run through the model.", registry=self.registry)
        self.queue_wait = Histogram(
            "detect_queue_wait_seconds", "Time an image waited in the queue before its model call.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.out_of_memory = Counter(
            "detect_out_of_memory", "Model calls that ran out of memory (ResourceExhaustedError).",
            registry=self.registry,
        )
        self.queue_depth = Gauge("detect_queue_depth", "Images waiting for a model call.", registry=self.registry)
        self.in_flight = Gauge("detect_http_requests_in_flight", "Requests received and not yet answered.",
                               registry=self.registry)
        if gpu_report is not None:
            self.registry.register(_GpuMemoryCollector(gpu_report))

    def observe_model_call(self, images: int, seconds: float) -> None:
        """Record one model call; the detector calls this after each call."""
        self.inference_latency.observe(seconds)
        self.images_per_call.observe(images)
        self.images.inc(images)

    def watch_in_flight(self, count) -> None:
        """Report the requests in flight, `count()`, at scrape time."""
        self.in_flight.set_function(count)

    def watch_queue(self, queue) -> None:
        """Report the inference queue's depth at scrape time."""
        self.queue_depth.set_function(lambda: queue.depth)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.request_latency.labels(route=route).observe(seconds)

    def observe_refusal(self, status: int) -> None:
        """Count a /detect request refused before it reached the app (overload, shutdown)."""
        self.requests.labels(route="/detect", status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
