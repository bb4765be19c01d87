"""The model registry: every model of the repository, the worker serving each, and the GPU budget they share.

This is the data plane the HTTP routes and protocols call. Each model has one bounded queue and its
batching threads, here in the HTTP process for its whole life; behind the queue, at most one worker
process serves it at a time (two, briefly, while a new version takes over). The queue outlives its
workers: a restart, an idle unload or a new version changes what runs the calls, not what waits.

States: unloaded -> loading -> ready -> unloading -> unloaded; failed after a load that cannot succeed
or too many crashes. Every state change happens under the registry's one lock and wakes its waiters;
the slow parts (starting a worker, loading, stopping) run outside it, in threads of their own.

- Budget: per GPU, the caps of the workers plus one gpu_overhead_mib each must fit (app.gpu.budget).
  A load that does not fit first unloads the least recently used idle model; if none can go, it fails
  with InsufficientGpuMemory. No worker starts that the budget cannot hold.
- Idle: a model idle for its idle_unload_s is unloaded; its next request loads it again.
- Versions: every model_poll_s the highest version on disk is compared with the one served; a new one
  loads beside the old if the budget holds both, else after the old has drained; a version that fails
  to load is not tried again until its folder changes.
- Crashes: a worker that exits unexpectedly is restarted with backoff and given up after max_failures
  in failure_window_s (app.supervision); the calls it had run again on its successor.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from ..errors import (
    DeadlineExceeded, DetectError, InsufficientGpuMemory, LoadFailed, ModelError, ModelNotFound, ModelUnavailable,
    WorkerLost, WorkerNotStarted,
)
from ..gpu.budget import Gpu, Ledger, cap_mib
from ..inference.batcher import InferenceQueue
from ..inference.detections import ModelOutputs
from ..inference.labels import load_label_map
from ..inference.working_size import WorkingSize, read_working_size
from ..settings import ModelSettings, Settings
from ..supervision import BOOT_ERROR, ExitHistory, RestartRule, describe_exit
from ..timeline import CallTimes, Timeline
from .history import MemoryHistory, sample_memory
from .repository import ModelRepository, ModelSource, ModelVersion, fingerprint
from .workers import WorkerPool, WorkerProcess

log = logging.getLogger(__name__)

TICK_S = 0.2  # how often the supervisor looks at idle models, due restarts and the model folders
STATES = ("unloaded", "loading", "ready", "unloading", "failed")


@dataclass
class _Attempt:
    """One load in progress: waiters learn its outcome from here."""

    version: ModelVersion
    reason: str  # why it loads: boot, request, restart, new version
    done: bool = False
    error: Optional[DetectError] = None
    started: float = field(default_factory=time.monotonic)


class ServedModel:
    """One model: its queue, its state and its worker. Every field is guarded by the registry's lock."""

    def __init__(self, registry: "ModelRegistry", source: ModelSource, settings: ModelSettings):
        self.registry = registry
        self.name = source.name
        self.source = source
        self.settings = settings
        self.state = "unloaded"
        self.reason: Optional[str] = None  # why it is failed or restarting, or why the last load failed
        self.worker: Optional[WorkerProcess] = None  # the worker new calls go to
        self.version: Optional[ModelVersion] = None  # the version served (or last served)
        self.labels: dict[int, str] = {}
        # What the last worker to serve it said of its signature, kept while the model is unloaded, so that
        # protocol metadata answers without a load: the contract's view, and the signature_def map.
        self.signature: Optional[dict] = None
        self.signature_defs: Optional[dict] = None
        self._working_size: tuple[Optional[Path], Optional[WorkingSize]] = (None, None)  # (version folder, its size)
        self.attempt: Optional[_Attempt] = None
        self.history = ExitHistory(registry.restart_rule)
        self.unloaded_by_request = False
        self.restart_at: Optional[float] = None
        # The budget reservation of a worker that crashed, kept for its restart so that no other model's load
        # takes the place it is owed (the calls it had run again on the successor).
        self.kept_reservation: Optional[object] = None
        self.in_flight = 0  # requests admitted for this model and not yet answered
        self.last_used = time.monotonic()
        self.last_used_unix: Optional[float] = None
        self.loads = 0
        self.last_load_s: Optional[float] = None
        self.last_load_unix: Optional[float] = None
        self.failed_versions: dict[str, tuple[tuple, str]] = {}  # version -> (fingerprint, reason)
        self.swapping: Optional[str] = None  # the version loading beside the served one
        self.unloading_idle = False  # an idle unload is under way
        self._seen: dict[str, tuple] = {}  # version -> fingerprint at the last poll
        metrics = registry.metrics
        self.queue = InferenceQueue(
            self._run_batch, max_batch=settings.max_batch_size, max_delay_s=settings.max_batch_delay_ms / 1000.0,
            threads=settings.inference_threads, max_queue=settings.max_queue,
            on_wait=metrics.queue_wait.labels(model=self.name).observe if metrics is not None else None,
        )

    # The request path ------------------------------------------------------------------------------

    def working_size(self) -> Optional[WorkingSize]:
        """The working size the version served (or about to be) declares in model_info.json, or None.

        Read in the HTTP process, without TensorFlow, once per version folder. A file that cannot be read
        is logged and the model's images are decoded at full size: answers stay right, only slower.
        """
        version = self.version or self.source.latest()
        if version is None:
            return None
        folder, size = self._working_size
        if folder != version.path:
            try:
                size = read_working_size(version.path)
            except ModelError as exc:
                log.warning("model %s: %s; decoding its images at full size", self.name, exc.message)
                size = None
            if size is not None:
                log.info("model %s version %s: decoding images no larger than it needs: %s", self.name,
                         version.version, size.describe())
            self._working_size = (version.path, size)
        return size

    def admit(self) -> None:
        """Count a request in: it holds the model loaded (no idle unload, no eviction) until `release`.

        A model that is unloaded (idle, or never loaded) starts loading now, while the request decodes. One
        unloaded by request, or being unloaded, refuses it at once (ModelUnavailable), so that the unload drains
        only the requests admitted before it.
        """
        with self.registry.lock:
            if self.unloaded_by_request:
                raise ModelUnavailable(f"model {self.name} was unloaded by request; load it with POST "
                                       f"/v2/repository/models/{self.name}/load")
            self.in_flight += 1
            self.last_used = time.monotonic()
            if self.state == "unloaded" and not self.unloaded_by_request and not self.registry.closing:
                version = self.version_to_load()
                if version is not None:
                    self._begin_load(version, "request")

    def release(self) -> None:
        with self.registry.lock:
            self.in_flight -= 1
            self.last_used = time.monotonic()
            self.last_used_unix = time.time()
            self.registry.lock.notify_all()

    def wait_ready(self, deadline: float) -> float:
        """Wait until the model is ready, loading it if need be; return the seconds waited for it.

        Raise ModelUnavailable (failed, restarting past the deadline, or unloaded by request),
        InsufficientGpuMemory, or DeadlineExceeded (a load slower than the request's deadline).
        """
        started = time.monotonic()
        with self.registry.lock:
            was_ready = self.state == "ready" and self.worker is not None and self.worker.alive
            self._worker_or_wait(deadline, for_request=True)
        return 0.0 if was_ready else time.monotonic() - started

    def _worker_or_wait(self, deadline: float, for_request: bool) -> WorkerProcess:
        """Return the worker to call, waiting for a load, restart or new version; call under the lock.

        Requests (`for_request`) wait while the model unloads; calls already queued still run on it.
        """
        lock = self.registry.lock
        attempt = None
        while True:
            worker = self.worker
            if worker is not None and worker.alive and (
                    self.state == "ready" or (self.state == "unloading" and not for_request)):
                return worker
            if self.state == "failed":
                raise ModelUnavailable(f"model {self.name} is failed: {self.reason}")
            if self.state == "unloaded" or (for_request and self.unloaded_by_request):
                if self.unloaded_by_request:
                    raise ModelUnavailable(
                        f"model {self.name} was unloaded by request; load it with POST "
                        f"/v2/repository/models/{self.name}/load")
                if attempt is not None and attempt.done and attempt.error is not None:
                    raise attempt.error
                if self.registry.closing:
                    raise ModelUnavailable("the server is shutting down")
                attempt = self._begin_load(self.version_to_load(), "request")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.unavailable_error()
            lock.wait(min(remaining, 1.0))

    def unavailable_error(self) -> DetectError:
        """What a request whose deadline passed while the model could not run gets (under the lock)."""
        if self.state == "loading" and self.attempt is not None and self.attempt.reason != "restart":
            return DeadlineExceeded(f"model {self.name} did not load within the request deadline "
                                    f"({self.registry.settings.request_deadline_s:g} s)")
        return ModelUnavailable(f"model {self.name} is unavailable: {self.reason or 'its worker is not back'}")

    def detect_outputs(self, images, deadline: float, timeline: Optional[Timeline] = None) -> list:
        """Queue the images and wait for the model's outputs, one per image; raise per-image errors.

        With a `timeline`, add the stages from the queue to the request's thread having the answers.
        """
        from concurrent.futures import TimeoutError as FutureTimeout

        queued = self.queue.submit(images, deadline)
        outputs = []
        for future in queued:
            try:
                outputs.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                for pending in queued:
                    pending.cancel()
                with self.registry.lock:
                    if self.state != "ready":  # it went away meanwhile: say so rather than "busy"
                        raise self.unavailable_error() from None
                raise DeadlineExceeded(
                    f"no answer within the request deadline of {self.registry.settings.request_deadline_s:g} s; "
                    "the server is busy") from None
        if timeline is not None and queued:
            last = max(queued, key=lambda item: item.call.read if item.call is not None else item.taken)
            last.add_stages(timeline, time.monotonic())
        return outputs

    def _run_batch(self, images, deadline: float, call: CallTimes) -> list:
        """Run one batch on the serving worker; on a crash, again on its successor while the deadline allows.

        `call` gets the marks of the attempt that answered; the time of one lost to a crash counts as batching.
        """
        while True:
            with self.registry.lock:
                worker = self._worker_or_wait(deadline, for_request=False)
            try:
                results = worker.run(images, observe=self._observe_call, call=call, deadline=deadline)
                version = worker.model.version
                return [replace(r, version=version) if isinstance(r, ModelOutputs) else r for r in results]
            except WorkerLost as exc:
                log.warning("model %s: %s; the call runs again once a worker is back", self.name, exc.message)
                if time.monotonic() >= deadline:
                    raise ModelUnavailable(
                        f"model {self.name}'s worker went away and no successor was ready within the deadline"
                    ) from None

    def _observe_call(self, images: int, seconds: float, out_of_memory: int) -> None:
        metrics = self.registry.metrics
        if metrics is not None:
            metrics.observe_model_call(self.name, images, seconds)
            if out_of_memory:
                metrics.out_of_memory.labels(model=self.name).inc(out_of_memory)

    # Loading ---------------------------------------------------------------------------------------

    def _begin_load(self, version: Optional[ModelVersion], reason: str) -> _Attempt:
        """Start loading `version` in a thread of its own; call under the lock with the model unloaded."""
        if version is None:
            self.state, self.reason = "failed", f"no version in {self.source.base}"
            raise ModelUnavailable(f"model {self.name} has no version on disk ({self.source.base})")
        attempt = _Attempt(version, reason)
        self.attempt = attempt
        self.state = "loading"
        self.restart_at = None
        threading.Thread(target=self._load, args=(attempt,), name=f"load-{self.name}", daemon=True).start()
        return attempt

    def _load(self, attempt: _Attempt) -> None:
        """Load a version as the model's only worker (the loader thread); publish the outcome."""
        registry = self.registry
        try:
            worker = registry.start_worker(self, attempt.version, evict=True)
        except DetectError as exc:
            with registry.lock:
                attempt.done, attempt.error = True, _as_request_error(exc, self.name)
                self._load_failed(attempt, exc, worker_crashed=isinstance(exc, WorkerLost))
                registry.lock.notify_all()
            return
        with registry.lock:
            attempt.done = True
            self._publish(worker, attempt.version, time.monotonic() - attempt.started)
            registry.lock.notify_all()

    def _publish(self, worker: WorkerProcess, version: ModelVersion, seconds: float) -> None:
        """Make `worker` the one that serves (under the lock); `seconds` since the load was asked for.

        The load's own time (`last_load_s`, the load histogram, the eviction rule's break-even) starts once
        the budget was had: a load that waited for room would otherwise make the next eviction wait longer,
        that load's wait longer again, and so on, until requests ran out of their deadline.
        """
        self.worker, self.version, self.state, self.reason = worker, version, "ready", None
        self.restart_at = None  # a swap's worker that takes over from a crashed one ends its pending restart
        if self.kept_reservation is not None:  # ... and the budget kept for that restart goes back
            self.registry.ledger.release(self.kept_reservation)
            self.kept_reservation = None
        self.labels = self.registry.labels_of(version)
        self.signature = worker.loaded.get("signature")
        self.signature_defs = worker.loaded.get("signature_defs")
        model_batch = worker.loaded.get("max_batch")
        self.queue.set_max_batch(min(self.settings.max_batch_size, model_batch or self.settings.max_batch_size))
        now = time.monotonic()
        own_s = now - worker.reserved_at  # start_worker set it
        self.loads += 1
        self.last_load_s = own_s
        self.last_load_unix = time.time()
        self.last_used = now
        self.failed_versions.pop(version.version, None)
        self.registry.observe_load(self, own_s)
        waited = f", {seconds - own_s:.2f} s of it waiting for room in the budget" if seconds - own_s >= 0.01 else ""
        log.info("model %s version %s ready in %.2f s%s on worker %d (%s)", self.name, version.version, seconds,
                 waited, worker.pid, _policy_text(worker))

    def _load_failed(self, attempt: _Attempt, exc: DetectError, worker_crashed: bool) -> None:
        """Record a failed load (under the lock): retry a crash with backoff, else fail or stay unloaded."""
        version = attempt.version
        self.registry.observe_load_failure(self)
        if isinstance(exc, InsufficientGpuMemory):
            self.state, self.reason = "unloaded", exc.message
            log.warning("model %s: %s", self.name, exc.message)
            return
        if worker_crashed:
            verdict = self.history.record(time.monotonic())
            if not verdict.give_up:
                self.state, self.reason = "loading", f"{exc.message}; {verdict.reason}"
                self.restart_at = time.monotonic() + verdict.delay_s
                self.attempt = _Attempt(version, "restart")
                log.warning("model %s: %s", self.name, self.reason)
                return
        if not isinstance(exc, WorkerNotStarted):  # the model's own fault, not the host's: do not try it again
            self.failed_versions[version.version] = (fingerprint(version.path), exc.message)
        fallback = self.version_to_load()
        if fallback is not None and fallback.version != version.version and not self.registry.closing:
            # A corrupt newer version found while the model was unloaded: serve the newest good one.
            log.error("model %s: version %s failed to load: %s; loading version %s instead", self.name,
                      version.version, exc.message, fallback.version)
            self.reason = f"version {version.version}: {exc.message}; loading version {fallback.version}"
            self._begin_load(fallback, attempt.reason)
            return
        self.state, self.reason = "failed", f"version {version.version}: {exc.message}"
        log.error("model %s is failed: %s", self.name, self.reason)

    def worker_exited(self, worker: WorkerProcess, code: int) -> bool:
        """Handle the exit of the worker that served this model (under the lock); return whether it restarts."""
        if self.worker is not worker:
            return False
        self.worker = None
        if worker.expected_exit:
            return False
        self.registry.observe_restart(self)
        verdict = self.history.record(time.monotonic(), boot_error=code == BOOT_ERROR)
        what = f"its worker {worker.pid} {describe_exit(code)}"
        if verdict.give_up:
            self.state, self.reason = "failed", f"{what}; given up after {verdict.reason}"
            log.error("model %s: %s; requests for it get 503 until it is loaded by request", self.name, what)
            return False
        self.state, self.reason = "loading", f"{what}; {verdict.reason}"
        self.restart_at = time.monotonic() + verdict.delay_s
        self.attempt = _Attempt(self.version, "restart")
        log.warning("model %s: %s", self.name, self.reason)
        return True

    # Unloading -------------------------------------------------------------------------------------

    def unload(self, reason: str, by_request: bool = False, timeout_s: float = 30.0) -> bool:
        """Drain the model's requests and end its worker (in the calling thread); its memory comes back.

        Idle and eviction unloads (`by_request` False) happen only while the model is still idle; return
        whether it was unloaded. An unload by request waits for a load in progress up to `timeout_s`, and
        raises ModelUnavailable if the load outlasts it (the model is left to load and serve).
        """
        registry = self.registry
        deadline = time.monotonic() + timeout_s
        with registry.lock:
            if by_request:
                self.unloaded_by_request = True
                while self.state == "loading" and time.monotonic() < deadline:
                    registry.lock.wait(0.5)  # let a load finish before unloading it
                if self.state == "loading":  # still: leave it be, rather than ready and refusing every request
                    self.unloaded_by_request = False
                    raise ModelUnavailable(f"model {self.name} is still loading after {timeout_s:g} s and was not "
                                           "unloaded; ask again once it is ready")
                if self.state == "failed":
                    self.state = "unloaded"
            elif self.idle_for(time.monotonic()) is None:
                return False
            if self.state != "ready":
                return False
            self.state = "unloading"
            while self.in_flight and time.monotonic() < deadline:
                registry.lock.wait(0.5)
            worker, self.worker = self.worker, None
            registry.lock.notify_all()
        if worker is not None:
            worker.drain(max(0.0, deadline - time.monotonic()))
            worker.stop(10.0)
            registry.observe_unload(self, reason)
            log.info("model %s version %s unloaded (%s); worker %d exited", self.name,
                     self.version.version if self.version else "?", reason, worker.pid)
        with registry.lock:
            self.state = "unloaded"
            registry.lock.notify_all()
        return True

    def idle_for(self, now: float) -> Optional[float]:
        """Return how long the model has been idle, or None if it is busy (under the lock)."""
        if self.state != "ready" or self.in_flight or self.queue.depth or (self.worker and self.worker.calls):
            return None
        return now - self.last_used

    # New versions ----------------------------------------------------------------------------------

    def version_to_load(self) -> Optional[ModelVersion]:
        """Return the newest version on disk that has not failed to load as it is now (under the lock).

        A corrupt version that failed to take over keeps failing while its folder is unchanged: a model
        unloaded since (idle, evicted) loads the newest good one instead. If every version failed, the latest.
        """
        versions = self.source.versions()
        for version in reversed(versions):
            failed = self.failed_versions.get(version.version)
            if failed is None or failed[0] != fingerprint(version.path):
                return version
        return versions[-1] if versions else None

    def new_version(self) -> Optional[ModelVersion]:
        """Return a newer version to serve, once its folder has stopped changing (under the lock)."""
        if self.state not in ("ready", "failed") or self.swapping or self.source.pinned is not None:
            return None
        latest = self.source.latest()
        if latest is None or (self.version is not None and latest.version == self.version.version
                              and self.state == "ready"):
            return None
        now_print = fingerprint(latest.path)
        settled = self._seen.get(latest.version) == now_print
        self._seen = {latest.version: now_print}
        failed = self.failed_versions.get(latest.version)
        if not settled or (failed is not None and failed[0] == now_print):
            return None
        return latest

    def swap(self, version: ModelVersion) -> None:
        """Serve `version` instead of the one served now (in a thread of its own), without failing a request."""
        registry = self.registry
        with registry.lock:
            self.swapping = version.version
            old = self.worker
            was_failed = self.state == "failed"
        try:
            if old is None or was_failed:
                self._replace_failed(version)
                return
            started = time.monotonic()
            try:
                worker = registry.start_worker(self, version, evict=False)
            except InsufficientGpuMemory:
                self._swap_after_drain(old, version)
                return
            except DetectError as exc:
                self._version_failed(version, exc)
                return
            with registry.lock:
                self._publish(worker, version, time.monotonic() - started)
                registry.lock.notify_all()
            log.info("model %s: version %s serves beside version %s, which drains", self.name, version.version,
                     old.model.version if old.model else "?")
            old.drain(registry.settings.request_deadline_s)
            old.stop(10.0)
            registry.observe_unload(self, "replaced")
        finally:
            with registry.lock:
                self.swapping = None
                registry.lock.notify_all()

    def _swap_after_drain(self, old: WorkerProcess, version: ModelVersion) -> None:
        """The budget holds one of them: drain the old version, then load the new; requests wait meanwhile."""
        registry = self.registry
        previous = self.version
        with registry.lock:
            self.state, self.worker = "loading", None
            self.attempt = _Attempt(version, "new version")
        log.info("model %s: the budget does not hold versions %s and %s at once; the old one drains first",
                 self.name, previous.version if previous else "?", version.version)
        old.drain(registry.settings.request_deadline_s)
        old.stop(10.0)
        registry.observe_unload(self, "replaced")
        for candidate in (version, previous):
            if candidate is None:
                continue
            started = time.monotonic()
            try:
                worker = registry.start_worker(self, candidate, evict=True)
            except DetectError as exc:
                if candidate is version:
                    self._version_failed(version, exc, keep_state=True)
                    continue
                with registry.lock:
                    self.attempt.done, self.attempt.error = True, _as_request_error(exc, self.name)
                    self._load_failed(self.attempt, exc, worker_crashed=isinstance(exc, WorkerLost))
                    registry.lock.notify_all()
                return
            with registry.lock:
                self.attempt.done = True
                self._publish(worker, candidate, time.monotonic() - started)
                registry.lock.notify_all()
            return

    def _replace_failed(self, version: ModelVersion) -> None:
        with self.registry.lock:
            if self.state != "failed":
                return
            self.state = "unloaded"
            self.history.clear()
            self._begin_load(version, "new version")

    def _version_failed(self, version: ModelVersion, exc: DetectError, keep_state: bool = False) -> None:
        with self.registry.lock:
            self.failed_versions[version.version] = (fingerprint(version.path), exc.message)
            self.registry.observe_load_failure(self)
        log.error("model %s: version %s cannot be loaded (%s); %s", self.name, version.version, exc.message,
                  "the previous version loads again" if keep_state else "the served version keeps serving")

    # Reporting -------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """Describe the model for /models (under the lock)."""
        worker = self.worker
        on_disk = [v.version for v in self.source.versions()]
        versions = []
        for number in on_disk:
            if self.version is not None and number == self.version.version and self.state != "unloaded":
                state = self.state
            elif number == self.swapping:
                state = "loading"
            elif number in self.failed_versions:
                state = "failed"
            else:
                state = "unloaded"
            entry = {"version": number, "state": state}
            if number in self.failed_versions:
                entry["reason"] = self.failed_versions[number][1]
            versions.append(entry)
        return {
            "name": self.name,
            "state": self.state,
            "reason": self.reason,
            "version": self.version.version if self.version is not None and self.state != "unloaded" else None,
            "versions": versions,
            "pid": worker.pid if worker is not None else None,
            "gpu_memory": str(self.settings.gpu_memory),
            "caps_mib": {str(k): v for k, v in self.registry.caps_for(self).items()},
            "in_flight": self.in_flight,
            "queue_depth": self.queue.depth,
            "last_used_unix": self.last_used_unix,
            "idle_unload_s": self.settings.idle_unload_s,
            "loads": self.loads,
            "last_load_s": None if self.last_load_s is None else round(self.last_load_s, 3),
            "last_load_unix": self.last_load_unix,
            "unloaded_by_request": self.unloaded_by_request,
            "signature": worker.loaded.get("signature") if worker is not None and worker.loaded else None,
            # the label map of the version last loaded, in id order; [] before a first load
            "labels": [self.labels[k] for k in sorted(self.labels)],
        }


class ModelRegistry:
    """All models, their workers and the GPU budget; thread-safe (one lock, one supervisor thread)."""

    def __init__(self, settings: Settings, repository: ModelRepository, gpus: Optional[list[Gpu]],
                 metrics=None, nvml=None, worker_command: Optional[list[str]] = None):
        self.settings = settings
        self.repository = repository
        self.metrics = metrics
        self.nvml = nvml  # the HTTP process's NVML session, for what each worker holds; None without it
        self.lock = threading.Condition()
        self.closing = False
        self.restart_rule = RestartRule(settings.max_failures, settings.failure_window_s, settings.restart_backoff_s)
        self.gpus = gpus  # None: no GPU inventory, nothing to budget against
        self.ledger = Ledger(gpus or [], settings.gpu_overhead_mib)
        self.pool = WorkerPool(settings.spare_workers, settings.log_level, self._worker_exited,
                               rule=self.restart_rule, command=worker_command)
        self.models = {name: ServedModel(self, repository.get(name), settings.for_model(name))
                       for name in repository.names()}
        self._preloaded: list[ServedModel] = [m for m in self.models.values() if m.settings.preload]
        self._supervisor = threading.Thread(target=self._supervise, name="model-supervisor", daemon=True)
        self._stop = threading.Event()
        self._next_poll = 0.0
        self._reservations = 0
        self.history = MemoryHistory()  # the last minutes of memory per model, sampled by the supervisor
        if metrics is not None:
            metrics.watch_models(self)

    # Lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin loading the preloaded models that fit the budget together, then start the spares and supervisor.

        Preloaded models that the budget cannot hold beside those before them (in name order) load at
        their first request instead, taking turns with the others.
        """
        trial = Ledger(self.gpus or [], self.settings.gpu_overhead_mib)
        with self.lock:
            for model in list(self._preloaded):
                short = trial.reserve(model.name, model.name, self.caps_for(model))
                if short is not None:
                    self._preloaded.remove(model)
                    log.warning("model %s is not preloaded: %s beside %s; it loads at its first request", model.name,
                                short.describe(), ", ".join(short.holders) or "nothing")
                    continue
                model._begin_load(model.source.latest(), "boot")
        self.pool.start()
        self._supervisor.start()

    @property
    def ready(self) -> bool:
        """True once every preloaded model has loaded and none of them is failed."""
        with self.lock:
            return not self.closing and all(m.loads > 0 and m.state != "failed" for m in self._preloaded)

    def boot_failure(self) -> Optional[str]:
        """Return why a preloaded model failed its first load at boot, or None."""
        with self.lock:
            for model in self._preloaded:
                if model.state == "failed" and model.loads == 0:
                    return f"model {model.name}: {model.reason}"
        return None

    def close(self, timeout_s: float = 20.0) -> None:
        """Stop taking loads, run what is queued, and stop every worker."""
        with self.lock:
            self.closing = True
            self.lock.notify_all()
        self._stop.set()
        for model in self.models.values():
            model.queue.close(timeout_s)
        self.pool.close(timeout_s)
        if self._supervisor.is_alive():
            self._supervisor.join(5.0)

    # Finding models --------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self.models)

    def get(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(f"no model named {name[:100]!r}; the models are {', '.join(self.names())}")
        return model

    def default(self) -> ServedModel:
        """Return the model POST /detect serves: the only model, else default_model."""
        if len(self.models) == 1:
            return next(iter(self.models.values()))
        name = self.settings.default_model
        if name:
            return self.get(name)
        raise ModelNotFound(
            f"no default model: the repository holds {', '.join(self.names())}; set default_model, or POST "
            "/models/<name>/detect")

    def default_name(self) -> Optional[str]:
        """The name of the model POST /detect serves, or None where there is none (several, no default_model)."""
        try:
            return self.default().name
        except DetectError:
            return None

    # Load and unload by request --------------------------------------------------------------------

    def load(self, name: str) -> ServedModel:
        """Load a model (its latest version) and wait until it is ready; raise LoadFailed or InsufficientGpuMemory.

        A failed model is tried afresh, and one unloaded by request is served again.
        """
        model = self.get(name)
        deadline = time.monotonic() + self.settings.load_timeout_s + 10
        with self.lock:
            model.unloaded_by_request = False
            while model.state == "unloading" and time.monotonic() < deadline:
                self.lock.wait(0.5)
            if model.state == "failed" or (model.state == "loading" and model.restart_at is not None):
                model.state, model.restart_at = "unloaded", None
                model.history.clear()
            if model.state == "unloaded":
                model._begin_load(model.version_to_load(), "request")
            attempt = model.attempt
            while model.state != "ready" and time.monotonic() < deadline:
                if attempt is not None and attempt.done:
                    if model.attempt is attempt or model.state != "loading":
                        break
                    attempt = model.attempt  # a failed new version fell back to an older one: wait for that
                self.lock.wait(0.5)
            if model.state == "ready":
                return model
            error = attempt.error if attempt is not None else None
            reason = model.reason
        if isinstance(error, InsufficientGpuMemory):
            raise error
        raise LoadFailed(f"failed to load model {name}: {reason or 'it did not become ready in time'}")

    def unload(self, name: str) -> ServedModel:
        """Unload a model by request; requests for it get 503 until it is loaded by request again.

        A load still running after shutdown_grace_s is left to finish, and the caller told so (ModelUnavailable,
        503 with Retry-After), rather than answered as if the model were unloaded.
        """
        model = self.get(name)
        model.unload("requested", by_request=True, timeout_s=self.settings.shutdown_grace_s)
        return model

    # Workers and the budget ------------------------------------------------------------------------

    def caps_for(self, model: ServedModel) -> dict[int, Optional[int]]:
        """Return the model's cap on each GPU it may use (none without a GPU inventory)."""
        if not self.gpus:
            return {}
        wanted = model.settings.gpus
        gpus = [g for g in self.gpus if wanted is None or g.index in wanted]
        return {g.index: cap_mib(model.settings.gpu_memory, g) for g in gpus}

    def start_worker(self, model: ServedModel, version: ModelVersion, evict: bool) -> WorkerProcess:
        """Reserve the model's budget (evicting idle models if allowed), start a worker and load `version` in it."""
        caps = self.caps_for(model)
        with self.lock:  # a restart takes the place its crashed predecessor held
            key, model.kept_reservation = model.kept_reservation, None
        if key is None:
            key = self._reserve(model, version, caps, evict)
        reserved_at = time.monotonic()
        try:
            worker = self.pool.take(self.settings.load_timeout_s)
        except DetectError:
            self.ledger.release(key)
            raise
        worker.reservation, worker.reserved_at = key, reserved_at
        try:
            worker.load(version, {"gpu_memory": str(model.settings.gpu_memory),
                                  "gpus": _gpus_text(model.settings.gpus)},
                        lanes=model.settings.inference_threads, timeout_s=self.settings.load_timeout_s)
        except DetectError:
            if not worker.wait(10.0):  # a failed load exits; its reservation goes with it
                worker.kill()
                worker.wait(5.0)
            raise
        return worker

    def _reserve(self, model: ServedModel, version: ModelVersion, caps: dict, evict: bool) -> object:
        with self.lock:
            self._reservations += 1
            key = (model.name, version.version, self._reservations)
        label = f"{model.name}/{version.version}"
        give_up_at = None
        while True:
            short = self.ledger.reserve(key, label, caps)
            if short is None:
                return key
            victim, ripe_in_s = self._victim(model, short.gpu) if evict else (None, None)
            if victim is None and ripe_in_s is not None:
                # Idle models used too recently to be worth their reload: wait until one has been idle long
                # enough (a second past the soonest's time); one that gets busy again meanwhile stays.
                give_up_at = give_up_at or time.monotonic() + min(ripe_in_s + 1.0, self.settings.request_deadline_s)
                if time.monotonic() < give_up_at and not self.closing:
                    time.sleep(min(ripe_in_s, 0.1))
                    continue
            if victim is None:
                raise InsufficientGpuMemory(
                    f"loading model {model.name} needs {short.needed_mib} MiB on GPU {short.gpu} (its cap plus "
                    f"{self.ledger.overhead_mib} MiB overhead), and {short.available_mib} MiB of the budget are "
                    "left" + (f", held by {', '.join(short.holders)}" if short.holders else "")
                    + "; no idle model can be unloaded to make room")
            log.info("model %s: unloading idle model %s to make room on GPU %d", model.name, victim.name,
                     short.gpu)
            victim.unload("evicted")

    def _victim(self, loading: ServedModel, gpu: int) -> tuple[Optional[ServedModel], Optional[float]]:
        """Pick the model on `gpu` to unload: the least recently used of those idle for longer than their last
        load took (the break-even point: unloading one used more recently than that costs more in its reload
        than it frees). Return (victim, None), or (None, seconds until an idle one gets there), or (None, None)
        when none is idle.
        """
        now = time.monotonic()
        with self.lock:
            idle = [(m.idle_for(now), m) for m in self.models.values()
                    if m is not loading and gpu in self.caps_for(m)]
            candidates = [(seconds, m) for seconds, m in idle if seconds is not None]
            if not candidates:
                return None, None
            ripe = [(seconds, m) for seconds, m in candidates if seconds >= (m.last_load_s or 0.0)]
            if ripe:
                return max(ripe, key=lambda pair: pair[0])[1], None
            return None, min((m.last_load_s or 0.0) - seconds for seconds, m in candidates)

    def _worker_exited(self, worker: WorkerProcess, code: int) -> None:
        """Called from a worker's reader thread once its exit is reaped: its model, then its budget.

        The budget goes back, unless the worker crashed and its model restarts: then the restart keeps it.
        """
        kept = False
        with self.lock:
            for model in self.models.values():
                if model.worker_exited(worker, code) and worker.reservation is not None:
                    if model.kept_reservation is not None:
                        self.ledger.release(model.kept_reservation)
                    model.kept_reservation, kept = worker.reservation, True
            self.lock.notify_all()
        if worker.reservation is not None and not kept:
            self.ledger.release(worker.reservation)

    def labels_of(self, version: ModelVersion) -> dict[int, str]:
        try:
            return load_label_map(version.path / "label_map.pbtxt")
        except ModelError as exc:  # the worker loaded the same map; it does not fail here unless it changed
            log.warning("%s", exc.message)
            return {}

    def gpu_processes(self) -> dict[int, dict[str, int]]:
        """Return NVML's used MiB per GPU for each pid on the GPUs ({} without NVML)."""
        used: dict[int, dict[str, int]] = {}
        if self.nvml is not None:
            try:
                for device in self.nvml.snapshot():
                    for process in device.processes:
                        if process.used_mib is not None:
                            used.setdefault(process.pid, {})[str(device.index)] = process.used_mib
            except DetectError:
                pass
        return used

    def worker_memory(self, worker: WorkerProcess, gpu_processes: Optional[dict] = None) -> dict:
        """Return what a worker holds: NVML's used MiB per GPU for its pid where it can, else its RSS."""
        gpu_used = (gpu_processes if gpu_processes is not None else self.gpu_processes()).get(worker.pid, {})
        if gpu_used:
            return {"source": "nvml", "gpu_used_mib": gpu_used, "used_mib": sum(gpu_used.values()),
                    "rss_mib": worker.rss_mib(), "tensorflow": _tensorflow_memory(worker)}
        return {"source": "rss", "used_mib": worker.rss_mib(), "rss_mib": worker.rss_mib(),
                "note": "resident host memory: no GPU memory is in use by this worker" if self.gpus
                else "resident host memory: this host has no GPU, so GPU caps are not enforced here"}

    def describe(self, names: Optional[list[str]] = None) -> list[dict]:
        """Describe models for /models: state, versions, worker, cap, and the memory its worker holds."""
        with self.lock:
            chosen = [self.get(n) for n in names] if names is not None else [self.models[n] for n in self.names()]
            rows = [(m.to_json(), m.worker) for m in chosen]
        gpu_processes = self.gpu_processes() if any(worker for _, worker in rows) else {}
        for row, worker in rows:  # NVML and /proc are read outside the lock, NVML once
            row["memory"] = self.worker_memory(worker, gpu_processes) if worker is not None else None
        return [row for row, _ in rows]

    def spares(self) -> list[dict]:
        """Describe the spare workers: started, TensorFlow imported once `ready`, no model yet."""
        return [{"pid": w.pid, "ready": w.spare.is_set(), "rss_mib": w.rss_mib()} for w in self.pool.spares()]

    def workers(self) -> list[dict]:
        """Describe every model worker for /gpu: pid, model, version, caps, policy, TensorFlow's figures."""
        with self.lock:
            rows = [({"pid": m.worker.pid, "model": m.name, "version": m.worker.model.version,
                      "caps_mib": self.caps_for(m), "policy": (m.worker.loaded or {}).get("policy")}, m.worker)
                    for m in self.models.values() if m.worker is not None and m.worker.model is not None]
        for row, worker in rows:  # asked outside the lock: a busy worker answers within a second
            row["tensorflow"] = _tensorflow_memory(worker)
        return [row for row, _ in rows]

    # Supervision -----------------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self._tick(time.monotonic())
            except Exception:  # the supervisor must outlive any one bad tick
                log.exception("model supervisor tick failed")

    def _tick(self, now: float) -> None:
        poll = self.settings.model_poll_s > 0 and now >= self._next_poll
        if poll:
            self._next_poll = now + self.settings.model_poll_s
        idle, swaps = [], []
        with self.lock:
            if self.closing:
                return
            for model in self.models.values():
                if model.kept_reservation is not None and model.state != "loading":
                    self.ledger.release(model.kept_reservation)  # the restart it was kept for did not come
                    model.kept_reservation = None
                if model.state == "loading" and model.restart_at is not None and now >= model.restart_at:
                    model.restart_at = None
                    model.state = "unloaded"
                    model._begin_load(model.version or model.source.latest(), "restart")
                idle_s = model.idle_for(now)
                if idle_s is not None and 0 < model.settings.idle_unload_s <= idle_s and not model.unloading_idle:
                    model.unloading_idle = True
                    idle.append(model)
                if poll:
                    version = model.new_version()
                    if version is not None:
                        swaps.append((model, version))
        for model in idle:
            threading.Thread(target=self._unload_idle, args=(model,), name=f"unload-{model.name}",
                             daemon=True).start()
        for model, version in swaps:
            log.info("model %s: version %s appeared; loading it", model.name, version.version)
            threading.Thread(target=model.swap, args=(version,), name=f"swap-{model.name}", daemon=True).start()
        with self.lock:
            # A spare imports TensorFlow, seconds of CPU: not while a load competes for it.
            busy = any(m.state in ("loading", "unloading") or m.swapping for m in self.models.values())
        if not busy:
            self.pool.refill()
        if self.history.due(now):
            self.history.record(time.time(), sample_memory(self))

    def _unload_idle(self, model: ServedModel) -> None:
        try:
            model.unload("idle", timeout_s=self.settings.shutdown_grace_s)
        finally:
            with self.lock:
                model.unloading_idle = False

    # Metrics hooks ---------------------------------------------------------------------------------

    def observe_load(self, model: ServedModel, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_load(model.name, seconds)

    def observe_load_failure(self, model: ServedModel) -> None:
        if self.metrics is not None:
            self.metrics.model_load_failures.labels(model=model.name).inc()

    def observe_unload(self, model: ServedModel, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.model_unloads.labels(model=model.name, reason=reason).inc()

    def observe_restart(self, model: ServedModel) -> None:
        if self.metrics is not None:
            self.metrics.worker_restarts.labels(model=model.name).inc()


def _as_request_error(exc: DetectError, name: str) -> DetectError:
    """What a request waiting for a load gets when the load fails."""
    if isinstance(exc, (InsufficientGpuMemory, ModelUnavailable)):
        return exc
    return ModelUnavailable(f"model {name} cannot be loaded: {exc.message}")


def _tensorflow_memory(worker: WorkerProcess) -> list:
    """Ask a worker for TensorFlow's allocator figures; [] where its TensorFlow uses no GPU."""
    policy = (worker.loaded or {}).get("policy") or {}
    if not policy.get("gpus"):
        return []
    return worker.stats(1.0) or []


def _gpus_text(gpus: Optional[tuple[int, ...]]) -> str:
    if gpus is None:
        return ""
    return ",".join(str(i) for i in gpus) if gpus else "none"


def _policy_text(worker: WorkerProcess) -> str:
    policy = (worker.loaded or {}).get("policy") or {}
    gpus = policy.get("gpus") or []
    if not gpus:
        return f"GPU memory policy {policy.get('spec')}: {policy.get('note')}"
    return f"GPU memory policy {policy.get('spec')} on GPU(s) {', '.join(str(g['index']) for g in gpus)}"
