"""The model registry: every model of the repository, the GPU budget they share, and the spare workers.

This is the data plane the HTTP routes and protocols call: it finds a model by name (each model's own
lifecycle, from load to unload, is a ServedModel of app.models.served), and it decides what the models
share.

- Budget: per GPU, the caps of the workers plus one gpu_overhead_mib each must fit (app.gpu.budget).
  A load that does not fit first unloads the least recently used idle model; if none can go, it fails
  with InsufficientGpuMemory. No worker starts that the budget cannot hold.
- Idle: a model idle for its idle_unload_s is unloaded; its next request loads it again.
- Versions: every model_poll_s the highest version on disk is compared with the one served; a new one
  loads beside the old if the budget holds both, else after the old has drained; a version that fails
  to load is not tried again until its folder changes.
- Crashes: a worker that exits unexpectedly is restarted with backoff and given up after max_failures
  in failure_window_s (app.supervision); the calls it had run again on its successor. The budget of the
  crashed worker is kept for its restart.

The lock: `lock`, a threading.Condition, is the registry's. It guards the registry's own state (closing,
the budgets kept for restarts, the preloaded models, the reservation count) and, shared on purpose, every
ServedModel's fields, so that a decision over several models holds still (app.models.host says why and in
which order locks are taken). The ledger, the pool and each worker lock themselves; NVML, /proc, starting
and stopping workers happen outside the lock.

Threads: request threads (HTTP and gRPC) call get, default, load, unload, describe, workers and spares;
the reactor thread calls start, ready and boot_failure, and close runs at shutdown, outside the
reactor's loop; a model's loading thread calls start_worker (and through it the eviction, which may
wait for an idle model to ripen); a worker's reader thread calls `_worker_exited`; the supervisor
thread (`_supervise`, every TICK_S) releases budgets no restart came for, starts due restarts, idle
unloads and new versions, refills the spares and samples memory (app.models.history reads the models'
states under the lock).

Sides: the registry is a ModelHost (app.models.host) to its models, and calls of a model only its
public methods: begin_boot_load, restart_if_due, claim_idle_unload, unload_idle, load_by_request,
unload, new_version, swap, worker_exited, idle_for, and its queue's close; it reads its public fields
(its VersionChoice's failures among them, for /models) under the lock and never sets them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from ..errors import DetectError, InsufficientGpuMemory, ModelNotFound
from ..gpu.budget import Gpu, Ledger, cap_mib
from ..settings import Settings
from ..supervision import RestartRule
from .history import MemoryHistory, sample_memory
from .repository import ModelRepository, ModelVersion
from .member import Member
from .served import ServedModel
from .workers import WorkerPool, WorkerProcess

log = logging.getLogger(__name__)

TICK_S = 0.2  # how often the supervisor looks at idle models, due restarts and the model folders


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
        # The budget reservation of a worker that crashed, by model name, kept for its restart so that no other
        # model's load takes the place it is owed (the calls it had run again on the successor).
        self._kept: dict[str, object] = {}
        self._group_workers: dict[str, WorkerProcess] = {}  # each worker group's running worker, by group
        self._group_locks: dict[str, threading.Lock] = {}  # one load at a time per group
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
            counted = set()  # a worker group's budget is counted once, for its first member
            for model in list(self._preloaded):
                if budget_key(model) in counted:
                    model.begin_boot_load()
                    continue
                short = trial.reserve(budget_key(model), model.name, self.caps_for(model))
                if short is not None:
                    self._preloaded.remove(model)
                    log.warning("model %s is not preloaded: %s beside %s; it loads at its first request", model.name,
                                short.describe(), ", ".join(short.holders) or "nothing")
                    continue
                counted.add(budget_key(model))
                model.begin_boot_load()
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
        model.load_by_request(self.settings.load_timeout_s + 10)
        return model

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

    def start_worker(self, model: ServedModel, version: ModelVersion, evict: bool) -> Member:
        """Reserve the model's budget (evicting idle models if allowed), start a worker and load `version` in it.

        A member of a worker group loads into its group's worker where one runs (the group's budget is held
        once, by that worker), and else starts it, after the one on its way out has exited; one load at a time
        per group.
        """
        group = model.settings.worker_group
        if not group:
            return self._load_in(None, model, version, evict)
        with self.lock:
            group_lock = self._group_locks.setdefault(group, threading.Lock())
        with group_lock:
            with self.lock:
                worker = self._group_workers.get(group)
            if worker is not None and worker.alive:
                return self._load(worker, model, version, time.monotonic())
            if worker is not None:
                # On its way out (its last member unloaded): it holds the group's budget until it has exited,
                # and a new worker reserved meanwhile would find the budget short and evict a model for it.
                worker.wait(self.settings.load_timeout_s)
            return self._load_in(group, model, version, evict)

    def _load_in(self, group: Optional[str], model: ServedModel, version: ModelVersion, evict: bool) -> Member:
        """Reserve the budget of a new worker (the model's, or its group's), take a spare and load `version`."""
        caps = self.caps_for(model)
        with self.lock:  # a restart takes the place its crashed predecessor held
            key = self._kept.pop(budget_key(model), None)
        if key is None:
            key = self._reserve(model, version, caps, evict)
        reserved_at = time.monotonic()
        try:
            worker = self.pool.take(self.settings.load_timeout_s)
        except DetectError:
            self.ledger.release(key)
            raise
        worker.reservation, worker.group = key, group
        if group:
            with self.lock:
                self._group_workers[group] = worker
        return self._load(worker, model, version, reserved_at)

    def _load(self, worker: WorkerProcess, model: ServedModel, version: ModelVersion, reserved_at: float) -> Member:
        try:
            member = worker.load(version, {"gpu_memory": str(model.settings.gpu_memory),
                                           "gpus": _gpus_text(model.settings.gpus),
                                           "precision": model.settings.precision,
                                           "parity_gate": model.settings.parity_gate,
                                           "threshold": self.settings.default_threshold,
                                           "max_image_pixels": self.settings.max_image_pixels,
                                           "settled": model.settled_for(version)},
                                 lanes=model.settings.inference_threads, timeout_s=self.settings.load_timeout_s)
        except DetectError:
            if not worker.members and not worker.wait(10.0):  # a failed first load exits; its reservation with it
                worker.kill()
                worker.wait(5.0)
            raise
        member.reserved_at = reserved_at
        return member

    def release_kept_budget(self, model: ServedModel) -> None:
        """Give back the budget kept for the model's restart, if one is kept (the model's side, under the lock)."""
        key = self._kept.pop(budget_key(model), None)
        if key is not None:
            self.ledger.release(key)

    def _reserve(self, model: ServedModel, version: ModelVersion, caps: dict, evict: bool) -> object:
        group = model.settings.worker_group
        with self.lock:
            self._reservations += 1
            key = (budget_key(model), version.version, self._reservations)
        label = f"group {group}" if group else f"{model.name}/{version.version}"
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
                whose = f"its worker group {group}'s cap" if group else "its cap"
                raise InsufficientGpuMemory(
                    f"loading model {model.name} needs {short.needed_mib} MiB on GPU {short.gpu} ({whose} plus "
                    f"{self.ledger.overhead_mib} MiB overhead, once per worker), and {short.available_mib} MiB of the budget are "
                    "left" + (f", held by {', '.join(short.holders)}" if short.holders else "")
                    + "; no idle model can be unloaded to make room")
            log.info("model %s: unloading idle model %s to make room on GPU %d", model.name, victim.name,
                     short.gpu)
            victim.unload("evicted")

    def _victim(self, loading: ServedModel, gpu: int) -> tuple[Optional[ServedModel], Optional[float]]:
        """Pick the model on `gpu` to unload: the least recently used of those idle for longer than their last
        load took (the break-even point: unloading one used more recently than that costs more in its reload
        than it frees), leaving out a member of a worker group whose worker another member keeps busy. Return
        (victim, None), or (None, seconds until an idle one gets there), or (None, None) when none is idle.
        """
        now = time.monotonic()
        with self.lock:
            busy_groups = self._busy_groups(now)
            idle = [(m.idle_for(now), m) for m in self.models.values()
                    if m is not loading and gpu in self.caps_for(m) and m.settings.worker_group not in busy_groups]
            candidates = [(seconds, m) for seconds, m in idle if seconds is not None]
            if not candidates:
                return None, None
            ripe = [(seconds, m) for seconds, m in candidates if seconds >= (m.last_load_s or 0.0)]
            if ripe:
                return max(ripe, key=lambda pair: pair[0])[1], None
            return None, min((m.last_load_s or 0.0) - seconds for seconds, m in candidates)

    def _busy_groups(self, now: float) -> set[str]:
        """The worker groups with a member busy in their worker (under the lock).

        Unloading an idle member gives the budget back only with the worker, once its last member is
        unloaded; while another member is busy there, evicting this one would free nothing.
        """
        return {m.settings.worker_group for m in self.models.values()
                if m.settings.worker_group and m.worker is not None and m.idle_for(now) is None}

    def _worker_exited(self, worker: WorkerProcess, code: int) -> None:
        """Called from a worker's reader thread once its exit is reaped: its models, then its budget.

        The budget goes back, unless the worker crashed and its models restart: then the restart keeps it
        (a group's, once, for whichever member restarts first).
        """
        kept = False
        with self.lock:
            if worker.group and self._group_workers.get(worker.group) is worker:
                del self._group_workers[worker.group]
            for model in self.models.values():
                if model.worker_exited(worker, code) and worker.reservation is not None and not kept:
                    self.release_kept_budget(model)
                    self._kept[budget_key(model)], kept = worker.reservation, True
            self.lock.notify_all()
        if worker.reservation is not None and not kept:
            self.ledger.release(worker.reservation)

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
            rows = [(self._describe_model(m), m.worker) for m in chosen]
        gpu_processes = self.gpu_processes() if any(worker for _, worker in rows) else {}
        for row, worker in rows:  # NVML and /proc are read outside the lock, NVML once
            row["memory"] = self.worker_memory(worker, gpu_processes) if worker is not None else None
        return [row for row, _ in rows]

    def _describe_model(self, model: ServedModel) -> dict:
        """Describe a model for /models from its public fields (under the lock)."""
        worker = model.worker
        on_disk = [v.version for v in model.source.versions()]
        versions = []
        for number in on_disk:
            failure = model.choice.failure(number)
            if model.version is not None and number == model.version.version and model.state != "unloaded":
                state = model.state
            elif number == model.swapping:
                state = "loading"
            elif failure is not None:
                state = "failed"
            else:
                state = "unloaded"
            entry = {"version": number, "state": state}
            if failure is not None:
                entry["reason"] = failure
            versions.append(entry)
        return {
            "name": model.name,
            "state": model.state,
            "reason": model.reason,
            "version": model.version.version if model.version is not None and model.state != "unloaded" else None,
            "versions": versions,
            "pid": worker.pid if worker is not None else None,
            # the worker group it shares a worker with (None: a worker of its own) and the group's models by name
            "worker_group": model.settings.worker_group or None,
            "group_members": self.group_members(model.settings.worker_group),
            "gpu_memory": str(model.settings.gpu_memory),
            "caps_mib": {str(k): v for k, v in self.caps_for(model).items()},
            "in_flight": model.in_flight,
            "queue_depth": model.queue.depth,
            "last_used_unix": model.last_used_unix,
            "idle_unload_s": model.settings.idle_unload_s,
            "loads": model.loads,
            "last_load_s": None if model.last_load_s is None else round(model.last_load_s, 3),
            "last_load_unix": model.last_load_unix,
            "unloaded_by_request": model.unloaded_by_request,
            "signature": worker.loaded.get("signature") if worker is not None and worker.loaded else None,
            # how the loaded version computes: the precision in force and why, the parity gate's word; None unloaded
            "execution": model.execution,
            # the label map of the version last loaded, in id order; [] before a first load
            "labels": [model.labels[k] for k in sorted(model.labels)],
        }

    def group_members(self, group: str) -> list[str]:
        """The models that name a worker group, by name ([] for '': a worker of its own)."""
        return sorted(n for n, m in self.models.items() if group and m.settings.worker_group == group)

    def groups(self) -> list[dict]:
        """Describe the worker groups for /gpu: members, the one worker's pid, its cap and its one overhead."""
        with self.lock:
            names = sorted({m.settings.worker_group for m in self.models.values() if m.settings.worker_group})
            rows = []
            for group in names:
                members = self.group_members(group)
                worker = self._group_workers.get(group)
                rows.append({"name": group, "members": members,
                             "loaded": sorted(n for n in members if self.models[n].worker is not None),
                             "pid": worker.pid if worker is not None and worker.alive else None,
                             "caps_mib": {str(k): v for k, v in self.caps_for(self.models[members[0]]).items()},
                             "overhead_mib": self.ledger.overhead_mib})
        return rows

    def spares(self) -> list[dict]:
        """Describe the spare workers: started, TensorFlow imported once `ready`, no model yet."""
        return [{"pid": w.pid, "ready": w.spare.is_set(), "rss_mib": w.rss_mib()} for w in self.pool.spares()]

    def workers(self) -> list[dict]:
        """Describe every model worker for /gpu: pid, model, version, caps, policy, TensorFlow's figures."""
        with self.lock:
            rows = [({"pid": m.worker.pid, "model": m.name, "version": m.worker.model.version,
                      "worker_group": m.settings.worker_group or None,
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
            restarting = {budget_key(m) for m in self.models.values() if m.state == "loading"}
            for model in self.models.values():
                if budget_key(model) not in restarting:
                    self.release_kept_budget(model)  # the restart it was kept for did not come
                model.restart_if_due(now)
                if model.claim_idle_unload(now):
                    idle.append(model)
                if poll:
                    version = model.new_version()
                    if version is not None:
                        swaps.append((model, version))
        for model in idle:
            threading.Thread(target=model.unload_idle, args=(self.settings.shutdown_grace_s,),
                             name=f"unload-{model.name}", daemon=True).start()
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


def budget_key(model: ServedModel) -> str:
    """What holds a model's place in the budget: its worker group ('group:<name>'), else the model itself."""
    group = model.settings.worker_group
    return f"group:{group}" if group else model.name


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
