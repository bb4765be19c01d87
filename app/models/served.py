"""One served model: its queue, its state and its worker, through load, drain, swap and unload.

Each model has one bounded queue and its batching threads, here in the HTTP process for its whole life;
behind it, one Member (app.models.member) in a worker of its own or its worker group's (two, briefly, while
a new version takes over). The queue outlives them: a restart, an unload or a version changes what runs.

States: unloaded -> loading -> ready -> unloading -> unloaded; failed after a load that cannot succeed
or too many crashes. Every state change wakes the lock's waiters; the slow parts (starting a worker,
loading, draining, stopping) run outside the lock, in threads of their own.

The lock: the registry's, shared, as app.models.host sets out. Every field of a ServedModel (its
VersionChoice included) changes only under it, but two: the queue, which locks itself, and the
working-size cache, which a request thread replaces whole. A model takes the lock one way only, as
`self._lock`, the host's lock handed over at construction, and never holds it while a worker starts,
loads, drains or stops.

Threads: request threads call admit, wait_ready, detect_outputs, release and working_size, and
load_by_request and unload by request; the queue's batching threads run `_run_batch`; each load runs
`_load` in a thread of its own; the registry's supervisor calls restart_if_due, claim_idle_unload and
new_version, then starts a thread for each unload_idle and swap; a worker's reader thread reports its
exit, through the registry, to worker_exited; an eviction calls unload in the thread of the load that
needs the room.

Sides: a model uses of its registry only what ModelHost names (start_worker and release_kept_budget;
lock, closing, settings, metrics and restart_rule). The registry calls only a model's public methods
and reads its public fields under the lock; it never sets them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from ..errors import (
    DeadlineExceeded, DetectError, InsufficientGpuMemory, LoadFailed, ModelError, ModelUnavailable, WorkerLost,
    WorkerNotStarted,
)
from ..inference.batcher import InferenceQueue
from ..inference.detections import ModelOutputs
from ..inference.labels import load_label_map
from ..inference.working_size import WorkingSize, read_working_size
from ..metrics import ModelMetrics
from ..settings import ModelSettings
from ..supervision import BOOT_ERROR, ExitHistory, describe_exit
from ..timeline import CallTimes, Timeline
from .host import ModelHost
from .repository import ModelSource, ModelVersion, fingerprint
from .member import Member
from .versions import VersionChoice
from .workers import WorkerProcess

log = logging.getLogger(__name__)

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
    """One model: its queue, its state and its worker; its fields change under the registry's lock."""

    def __init__(self, host: ModelHost, source: ModelSource, settings: ModelSettings):
        self._host = host
        self._lock = host.lock  # the registry's, shared: see app.models.host
        self.name = source.name
        self.source = source
        self.settings = settings
        self.state = "unloaded"
        self.reason: Optional[str] = None  # why it is failed or restarting, or why the last load failed
        self.worker: Optional[Member] = None  # where new calls go: this model in its worker
        self.version: Optional[ModelVersion] = None  # the version served (or last served)
        self.labels: dict[int, str] = {}
        # What the last worker to serve it said of its signature, kept while the model is unloaded, so that
        # protocol metadata answers without a load: the contract's view, and the signature_def map.
        self.signature: Optional[dict] = None
        self.signature_defs: Optional[dict] = None
        # Each version's precision as its first load settled it (by _settle_key), for its next worker instead of
        # a new check; a crash forgets it. Written under the lock, read by this model's own load.
        self.settled: dict[tuple, dict] = {}
        self._working_size: tuple[Optional[Path], Optional[WorkingSize]] = (None, None)  # (version folder, its size)
        self._attempt: Optional[_Attempt] = None
        self._history = ExitHistory(host.restart_rule)
        self.unloaded_by_request = False
        self._restart_at: Optional[float] = None
        self.in_flight = 0  # requests admitted for this model and not yet answered
        self.last_used = time.monotonic()
        self.last_used_unix: Optional[float] = None
        self.loads = 0
        self.last_load_s: Optional[float] = None
        self.last_load_unix: Optional[float] = None
        self.choice = VersionChoice(source)  # which version to load; what failed
        self.swapping: Optional[str] = None  # the version loading beside the served one
        self._unloading_idle = False  # an idle unload is under way
        self._metrics = ModelMetrics(host.metrics, self.name)
        self.queue = InferenceQueue(
            self._run_batch, max_batch=settings.max_batch_size, max_delay_s=settings.max_batch_delay_ms / 1000.0,
            threads=settings.inference_threads, max_queue=settings.max_queue, on_wait=self._metrics.queue_wait,
            on_dropped=self._metrics.dropped,
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
        with self._lock:
            if self.unloaded_by_request:
                raise ModelUnavailable(f"model {self.name} was unloaded by request; load it with POST "
                                       f"/v2/repository/models/{self.name}/load")
            self.in_flight += 1
            self.last_used = time.monotonic()
            if self.state == "unloaded" and not self.unloaded_by_request and not self._host.closing:
                version = self.choice.to_load()
                if version is not None:
                    self._begin_load(version, "request")

    def release(self) -> None:
        with self._lock:
            self.in_flight -= 1
            self.last_used = time.monotonic()
            self.last_used_unix = time.time()
            self._lock.notify_all()

    def wait_ready(self, deadline: float) -> float:
        """Wait until the model is ready, loading it if need be; return the seconds waited for it.

        Raise ModelUnavailable (failed, restarting past the deadline, or unloaded by request),
        InsufficientGpuMemory, or DeadlineExceeded (a load slower than the request's deadline).
        """
        started = time.monotonic()
        with self._lock:
            was_ready = self.state == "ready" and self.worker is not None and self.worker.alive
            self._worker_or_wait(deadline, for_request=True)
        return 0.0 if was_ready else time.monotonic() - started

    def _worker_or_wait(self, deadline: float, for_request: bool) -> Member:
        """Return the worker to call, waiting for a load, restart or new version; call under the lock.

        Requests (`for_request`) wait while the model unloads; calls already queued still run on it.
        """
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
                if self._host.closing:
                    raise ModelUnavailable("the server is shutting down")
                attempt = self._begin_load(self.choice.to_load(), "request")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.unavailable_error()
            self._lock.wait(min(remaining, 1.0))

    def unavailable_error(self) -> DetectError:
        """What a request whose deadline passed while the model could not run gets (under the lock)."""
        if self.state == "loading" and self._attempt is not None and self._attempt.reason != "restart":
            return DeadlineExceeded(f"model {self.name} did not load within the request deadline "
                                    f"({self._host.settings.request_deadline_s:g} s)")
        return ModelUnavailable(f"model {self.name} is unavailable: {self.reason or 'its worker is not back'}")

    def detect_outputs(self, images, deadline: float, timeline: Optional[Timeline] = None, cancellation=None) -> list:
        """Queue the images and wait for the model's outputs, one per image; raise per-image errors.

        With a `timeline`, add the stages from the queue to the request's thread having the answers; a
        `cancellation` drops the images still queued when the client goes, each answered ClientGone."""
        queued = self.queue.submit(images, deadline, cancellation)
        outputs = []
        for future in queued:
            try:
                outputs.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                for pending in queued:
                    pending.cancel()
                with self._lock:
                    if self.state != "ready":  # it went away meanwhile: say so rather than "busy"
                        raise self.unavailable_error() from None
                raise DeadlineExceeded(
                    f"no answer within the request deadline of {self._host.settings.request_deadline_s:g} s; "
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
            with self._lock:
                worker = self._worker_or_wait(deadline, for_request=False)
            try:
                results = worker.run(images, observe=self._metrics.call, call=call, deadline=deadline)
                version = worker.model.version
                return [replace(r, version=version) if isinstance(r, ModelOutputs) else r for r in results]
            except WorkerLost as exc:
                log.warning("model %s: %s; the call runs again once a worker is back", self.name, exc.message)
                if time.monotonic() >= deadline:
                    raise ModelUnavailable(
                        f"model {self.name}'s worker went away and no successor was ready within the deadline"
                    ) from None

    # Loading ---------------------------------------------------------------------------------------

    def _begin_load(self, version: Optional[ModelVersion], reason: str) -> _Attempt:
        """Start loading `version` in a thread of its own; call under the lock with the model unloaded."""
        if version is None:
            self.state, self.reason = "failed", f"no version in {self.source.base}"
            raise ModelUnavailable(f"model {self.name} has no version on disk ({self.source.base})")
        attempt = _Attempt(version, reason)
        self._attempt = attempt
        self.state = "loading"
        self._restart_at = None
        threading.Thread(target=self._load, args=(attempt,), name=f"load-{self.name}", daemon=True).start()
        return attempt

    def _load(self, attempt: _Attempt) -> None:
        """Load a version as the model's only worker (the loader thread); publish the outcome."""
        try:
            worker = self._host.start_worker(self, attempt.version, evict=True)
        except DetectError as exc:
            with self._lock:
                attempt.done, attempt.error = True, _as_request_error(exc, self.name)
                self._load_failed(attempt, exc, worker_crashed=isinstance(exc, WorkerLost))
                self._lock.notify_all()
            return
        with self._lock:
            attempt.done = True
            self._publish(worker, attempt.version, time.monotonic() - attempt.started)
            self._lock.notify_all()

    def _publish(self, worker: Member, version: ModelVersion, seconds: float) -> None:
        """Make `worker` the one that serves (under the lock); `seconds` since the load was asked for.

        The load's own time (`last_load_s`, the load histogram, the eviction rule's break-even) starts once
        the budget was had: a load that waited for room would otherwise make the next eviction wait longer,
        that load's wait longer again, and so on, until requests ran out of their deadline.
        """
        self.worker, self.version, self.state, self.reason = worker, version, "ready", None
        self._restart_at = None  # a swap's worker that takes over from a crashed one ends its pending restart
        self._host.release_kept_budget(self)  # ... and the budget kept for that restart goes back
        self.labels = _labels_of(version)
        self.signature = worker.loaded.get("signature")
        self.signature_defs = worker.loaded.get("signature_defs")
        execution = worker.loaded.get("execution")
        if execution is not None and execution.get("reusable", True):
            self.settled[_settle_key(version)] = execution
        model_batch = worker.loaded.get("max_batch")
        self.queue.set_max_batch(min(self.settings.max_batch_size, model_batch or self.settings.max_batch_size))
        now = time.monotonic()
        own_s = now - worker.reserved_at  # start_worker set it
        self.loads += 1
        self.last_load_s = own_s
        self.last_load_unix = time.time()
        self.last_used = now
        self.choice.loaded(version)
        self._metrics.loaded(own_s)
        waited = f", {seconds - own_s:.2f} s of it waiting for room in the budget" if seconds - own_s >= 0.01 else ""
        log.info("model %s version %s ready in %.2f s%s on worker %d (%s)", self.name, version.version, seconds,
                 waited, worker.pid, _policy_text(worker))

    def _load_failed(self, attempt: _Attempt, exc: DetectError, worker_crashed: bool) -> None:
        """Record a failed load (under the lock): retry a crash with backoff, else fail or stay unloaded."""
        version = attempt.version
        self._metrics.load_failed()
        if isinstance(exc, InsufficientGpuMemory):
            self.state, self.reason = "unloaded", exc.message
            log.warning("model %s: %s", self.name, exc.message)
            return
        if worker_crashed:
            self.settled.pop(_settle_key(version), None)  # its next try checks the precision again
            verdict = self._history.record(time.monotonic())
            if not verdict.give_up:
                self.state, self.reason = "loading", f"{exc.message}; {verdict.reason}"
                self._restart_at = time.monotonic() + verdict.delay_s
                self._attempt = _Attempt(version, "restart")
                log.warning("model %s: %s", self.name, self.reason)
                return
        if not isinstance(exc, WorkerNotStarted):  # the model's own fault, not the host's: do not try it again
            self.choice.failed(version, exc.message)
        fallback = self.choice.to_load()
        if fallback is not None and fallback.version != version.version and not self._host.closing:
            # A corrupt newer version found while the model was unloaded: serve the newest good one.
            log.error("model %s: version %s failed to load: %s; loading version %s instead", self.name,
                      version.version, exc.message, fallback.version)
            self.reason = f"version {version.version}: {exc.message}; loading version {fallback.version}"
            self._begin_load(fallback, attempt.reason)
            return
        self.state, self.reason = "failed", f"version {version.version}: {exc.message}"
        log.error("model %s is failed: %s", self.name, self.reason)

    @property
    def execution(self) -> Optional[dict]:
        """How the serving worker computes (app/inference/parity.py's Execution as JSON); None without one."""
        worker = self.worker
        return (worker.loaded or {}).get("execution") if worker is not None else None

    def settled_for(self, version: ModelVersion) -> Optional[dict]:
        """What `version`, as its files are now, settled on at an earlier load, for its next worker; else None."""
        return self.settled.get(_settle_key(version))

    def worker_exited(self, worker: WorkerProcess, code: int) -> bool:
        """Handle the exit of the worker that served this model (under the lock); return whether it restarts."""
        if self.worker is None or self.worker.process is not worker:
            return False
        self.worker = None
        if worker.expected_exit:
            return False
        if self.version is not None:  # a crash: the restart checks the precision again instead of trusting it
            self.settled.pop(_settle_key(self.version), None)
        self._metrics.restarted()
        verdict = self._history.record(time.monotonic(), boot_error=code == BOOT_ERROR)
        what = f"its {worker.describe_kind()} {worker.pid} {describe_exit(code)}"
        if verdict.give_up:
            self.state, self.reason = "failed", f"{what}; given up after {verdict.reason}"
            log.error("model %s: %s; requests for it get 503 until it is loaded by request", self.name, what)
            return False
        self.state, self.reason = "loading", f"{what}; {verdict.reason}"
        self._restart_at = time.monotonic() + verdict.delay_s
        self._attempt = _Attempt(self.version, "restart")
        log.warning("model %s: %s", self.name, self.reason)
        return True

    # Unloading -------------------------------------------------------------------------------------

    def unload(self, reason: str, by_request: bool = False, timeout_s: float = 30.0) -> bool:
        """Drain the model's requests and end its worker (in the calling thread); its memory comes back.

        Idle and eviction unloads (`by_request` False) happen only while the model is still idle; return
        whether it was unloaded. An unload by request waits for a load in progress up to `timeout_s`, and
        raises ModelUnavailable if the load outlasts it (the model is left to load and serve).
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if by_request:
                self.unloaded_by_request = True
                while self.state == "loading" and time.monotonic() < deadline:
                    self._lock.wait(0.5)  # let a load finish before unloading it
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
                self._lock.wait(0.5)
            worker, self.worker = self.worker, None
            self._lock.notify_all()
        if worker is not None:
            worker.drain(max(0.0, deadline - time.monotonic()))
            exited = worker.stop(10.0) is not None  # a group's worker serves on while it has other members
            self._metrics.unloaded(reason)
            log.info("model %s version %s unloaded (%s); worker %d %s", self.name, self.version.version if self.version
                     else "?", reason, worker.pid, "exited" if exited else "released it and serves its group")
        with self._lock:
            self.state = "unloaded"
            self._lock.notify_all()
        return True

    def idle_for(self, now: float) -> Optional[float]:
        """Return how long the model has been idle, or None if it is busy (under the lock)."""
        if self.state != "ready" or self.in_flight or self.queue.depth or (self.worker and self.worker.calls):
            return None
        return now - self.last_used

    def claim_idle_unload(self, now: float) -> bool:
        """Return whether the model is due its idle unload, and if so mark it under way (under the lock).

        The supervisor calls it, then runs unload_idle in a thread of its own; until that ends, the model is
        not claimed again.
        """
        idle_s = self.idle_for(now)
        if idle_s is None or not 0 < self.settings.idle_unload_s <= idle_s or self._unloading_idle:
            return False
        self._unloading_idle = True
        return True

    def unload_idle(self, timeout_s: float) -> None:
        """Unload the model for its idleness (in a thread of its own), once claim_idle_unload said so."""
        try:
            self.unload("idle", timeout_s=timeout_s)
        finally:
            with self._lock:
                self._unloading_idle = False

    # Load by request, at boot, after a crash -------------------------------------------------------

    def begin_boot_load(self) -> None:
        """Start loading the latest version at boot (the registry's start, under the lock)."""
        self._begin_load(self.source.latest(), "boot")

    def restart_if_due(self, now: float) -> None:
        """Start the restart of a crashed worker once its backoff has passed (the supervisor, under the lock)."""
        if self.state == "loading" and self._restart_at is not None and now >= self._restart_at:
            self._restart_at = None
            self.state = "unloaded"
            self._begin_load(self.version or self.source.latest(), "restart")

    def load_by_request(self, timeout_s: float) -> None:
        """Load the model (its newest good version) and wait until it is ready, up to `timeout_s`.

        A failed model is tried afresh, and one unloaded by request is served again. Raise LoadFailed, or
        InsufficientGpuMemory when the budget cannot hold it.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self.unloaded_by_request = False
            while self.state == "unloading" and time.monotonic() < deadline:
                self._lock.wait(0.5)
            if self.state == "failed" or (self.state == "loading" and self._restart_at is not None):
                self.state, self._restart_at = "unloaded", None
                self._history.clear()
            if self.state == "unloaded":
                self._begin_load(self.choice.to_load(), "request")
            attempt = self._attempt
            while self.state != "ready" and time.monotonic() < deadline:
                if attempt is not None and attempt.done:
                    if self._attempt is attempt or self.state != "loading":
                        break
                    attempt = self._attempt  # a failed new version fell back to an older one: wait for that
                self._lock.wait(0.5)
            if self.state == "ready":
                return
            error = attempt.error if attempt is not None else None
            reason = self.reason
        if isinstance(error, InsufficientGpuMemory):
            raise error
        raise LoadFailed(f"failed to load model {self.name}: {reason or 'it did not become ready in time'}")

    # New versions ----------------------------------------------------------------------------------

    def new_version(self) -> Optional[ModelVersion]:
        """Return a newer version to serve, once its folder has stopped changing (the supervisor, under the lock)."""
        if self.state not in ("ready", "failed") or self.swapping or self.source.pinned is not None:
            return None
        serving = self.version.version if self.version is not None and self.state == "ready" else None
        return self.choice.settled_latest(serving)

    def swap(self, version: ModelVersion) -> None:
        """Serve `version` instead of the one served now (in a thread of its own), without failing a request."""
        with self._lock:
            self.swapping = version.version
            old = self.worker
            was_failed = self.state == "failed"
        try:
            if old is None or was_failed:
                self._replace_failed(version)
                return
            started = time.monotonic()
            try:
                worker = self._host.start_worker(self, version, evict=False)
            except InsufficientGpuMemory:
                self._swap_after_drain(old, version)
                return
            except DetectError as exc:
                self._version_failed(version, exc)
                return
            with self._lock:
                self._publish(worker, version, time.monotonic() - started)
                self._lock.notify_all()
            log.info("model %s: version %s serves beside version %s, which drains", self.name, version.version,
                     old.model.version if old.model else "?")
            old.drain(self._host.settings.request_deadline_s)
            old.stop(10.0)
            self._metrics.unloaded("replaced")
        finally:
            with self._lock:
                self.swapping = None
                self._lock.notify_all()

    def _swap_after_drain(self, old: Member, version: ModelVersion) -> None:
        """The budget holds one of them: drain the old version, then load the new; requests wait meanwhile."""
        previous = self.version
        with self._lock:
            self.state, self.worker = "loading", None
            self._attempt = _Attempt(version, "new version")
        log.info("model %s: the budget does not hold versions %s and %s at once; the old one drains first",
                 self.name, previous.version if previous else "?", version.version)
        old.drain(self._host.settings.request_deadline_s)
        old.stop(10.0)
        self._metrics.unloaded("replaced")
        for candidate in (version, previous):
            if candidate is None:
                continue
            started = time.monotonic()
            try:
                worker = self._host.start_worker(self, candidate, evict=True)
            except DetectError as exc:
                if candidate is version:
                    self._version_failed(version, exc, keep_state=True)
                    continue
                with self._lock:
                    self._attempt.done, self._attempt.error = True, _as_request_error(exc, self.name)
                    self._load_failed(self._attempt, exc, worker_crashed=isinstance(exc, WorkerLost))
                    self._lock.notify_all()
                return
            with self._lock:
                self._attempt.done = True
                self._publish(worker, candidate, time.monotonic() - started)
                self._lock.notify_all()
            return

    def _replace_failed(self, version: ModelVersion) -> None:
        with self._lock:
            if self.state != "failed":
                return
            self.state = "unloaded"
            self._history.clear()
            self._begin_load(version, "new version")

    def _version_failed(self, version: ModelVersion, exc: DetectError, keep_state: bool = False) -> None:
        with self._lock:
            self.choice.failed(version, exc.message)
            self._metrics.load_failed()
        log.error("model %s: version %s cannot be loaded (%s); %s", self.name, version.version, exc.message,
                  "the previous version loads again" if keep_state else "the served version keeps serving")


def _as_request_error(exc: DetectError, name: str) -> DetectError:
    """What a request waiting for a load gets when the load fails."""
    if isinstance(exc, (InsufficientGpuMemory, ModelUnavailable)):
        return exc
    return ModelUnavailable(f"model {name} cannot be loaded: {exc.message}")


def _labels_of(version: ModelVersion) -> dict[int, str]:
    try:
        return load_label_map(version.path / "label_map.pbtxt")
    except ModelError as exc:  # the worker loaded the same map; it does not fail here unless it changed
        log.warning("%s", exc.message)
        return {}


def _policy_text(worker: Member) -> str:
    policy = (worker.loaded or {}).get("policy") or {}
    gpus = policy.get("gpus") or []
    if not gpus:
        return f"GPU memory policy {policy.get('spec')}: {policy.get('note')}"
    return f"GPU memory policy {policy.get('spec')} on GPU(s) {', '.join(str(g['index']) for g in gpus)}"


def _settle_key(version: ModelVersion) -> tuple:
    """A version as its precision was settled: its number and its folder's fingerprint (files, sizes, times)."""
    return version.version, fingerprint(version.path)
