"""What runs inside a model's worker process, and nothing else does: `python -m app.models.worker --channel-fd N`.

A worker starts as a spare: it imports TensorFlow (the slow part, about 3.5 s here), creates no tensor
and applies no memory policy, says `spare` on its control channel and waits. Given a model (`load`),
it applies that model's memory policy (its worker group's, for a member of one) (TensorFlow's GPUs are still uninitialized, so the policy takes
effect), loads the model, settles its precision behind the parity gate (app/inference/parity.py),
warms it, says `loaded` with the signature and how it computes, and then serves model calls on its
lanes: each lane is a socket and a shared-memory buffer, served by a thread of its own, so that
`inference_threads` calls run at once. A load that fails says `load_failed` and exits with BOOT_ERROR.

A worker group's worker then takes more `load`s (each member beside the others, a ResidentModel of
app/models/resident.py, said `loaded` or `load_failed` with its member's name) and `unload`s (one member's
lanes closed and its TensorFlow objects released, the others serving on); the HTTP process stops it once
its last member is unloaded. The control channel also takes `stats` (TensorFlow's allocator figures) and `stop`. When the HTTP
process goes away, the channel closes and the worker exits: no orphan keeps GPU memory.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .resident import ResidentModel

log = logging.getLogger("app.worker")


class ModelWorker:
    """The worker's side: init_process (policy, first model), then run (control: more models, unloads, stats).

    A worker of its own hosts one model. A worker group's hosts each member as a ResidentModel
    (app/models/resident.py), loaded one at a time in a thread of its own so that the control channel stays
    answered, and each released by `unload` while the others serve.
    """

    def __init__(self, control):
        self.control = control
        self.policy = None
        self.residents: dict[str, "ResidentModel"] = {}
        self._lock = threading.Lock()

    @property
    def detector(self):
        """The first resident's detector (a worker of its own has only that one)."""
        return next(iter(self.residents.values())).detector

    @property
    def execution(self):
        return next(iter(self.residents.values())).execution

    def init_process(self, request: dict, fds: list[int]) -> "ResidentModel":
        """Apply the process's memory policy (its group's), load and warm the first model; raise DetectError."""
        from ..gpu.memory_policy import parse_gpu_list, parse_memory_spec
        from ..gpu.setup import setup_gpus

        model = request["model"]
        gpus = parse_gpu_list(model["gpus"])
        setup = setup_gpus(parse_memory_spec(model["gpu_memory"]), gpus)
        if setup.nvml is not None:
            setup.nvml.close()  # the HTTP process reads NVML; the worker only needed totals for a share
        self.policy = setup.policy
        return self._load(request, fds)

    def _load(self, request: dict, fds: list[int]) -> "ResidentModel":
        from .resident import ResidentModel

        resident = ResidentModel(request.get("member") or _name(request), request["model"])
        try:
            resident.load(self.policy.memory_limit())
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        resident.open_lanes(fds)
        with self._lock:
            self.residents[resident.member] = resident
        return resident

    def _load_more(self, request: dict, fds: list[int]) -> None:
        """Load another member beside those served (a thread of its own); say loaded or load_failed."""
        from ..errors import DetectError

        name = _name(request)
        member = request.get("member") or name
        began = time.perf_counter()
        try:
            resident = self._load(request, fds)
        except DetectError as exc:
            log.error("cannot load model %s: %s", name, exc.message)
            _say(self.control, {"event": "load_failed", "member": member,
                                "error": {"code": exc.code, "message": exc.message}})
            return
        except Exception as exc:  # a model that breaks the loader in a way of its own
            log.exception("cannot load model %s", name)
            _say(self.control, {"event": "load_failed", "member": member,
                                "error": {"code": "invalid_model", "message": f"{type(exc).__name__}: {exc}"}})
            return
        _say(self.control, {**resident.loaded_message(self.policy), "seconds": round(time.perf_counter() - began, 3)})
        log.info("model %s loaded and warmed in %.2f s beside %d other(s)", name, time.perf_counter() - began,
                 len(self.residents) - 1)

    def _unload(self, member: str) -> None:
        """Release one member: its lanes are closed by the HTTP process; its TensorFlow objects go."""
        with self._lock:
            resident = self.residents.pop(member, None)
        if resident is None:
            return
        ended = resident.release()
        log.info("model %s unloaded from this worker%s; %d model(s) left", member,
                 "" if ended else " (a lane thread had not ended)", len(self.residents))
        _say(self.control, {"event": "unloaded", "member": member})

    def run(self) -> int:
        """Serve the control channel until `stop` or the HTTP process goes away; the lanes serve themselves."""
        from .channel import ChannelClosed

        while True:
            try:
                header, _, fds = self.control.receive()
            except ChannelClosed:
                log.info("the server closed the control channel; exiting")
                return 0
            op = header.get("op")
            if op == "stop":
                log.info("stopping on request")
                return 0
            if op == "stats":
                self.control.send({"event": "stats", "id": header.get("id"), "tensorflow": self._tensorflow_memory()})
            elif op == "load":
                threading.Thread(target=self._load_more, args=(header, fds), name="load", daemon=True).start()
            elif op == "unload":
                self._unload(header.get("member", ""))

    def _tensorflow_memory(self) -> list:
        if self.policy is None or not self.policy.gpus:
            return []
        from ..gpu.memory_policy import tensorflow_memory_info

        try:
            return tensorflow_memory_info()
        except Exception as exc:  # a report, never a reason to fail
            return [{"error": str(exc)}]


def _name(request: dict) -> str:
    return f"{request['model']['name']}/{request['model']['version']}"


PR_SET_NO_NEW_PRIVS = 38  # linux/prctl.h


def drop_privileges() -> None:
    """Give up what a worker never needs, before any model code runs (SECURITY.md).

    No new privileges: nothing the model's graph may exec gains privileges through setuid or file
    capabilities. Umask 077: whatever the graph writes (TensorFlow's caches, a hostile op's files)
    is readable by this user only. Neither is a sandbox; SECURITY.md says what one would add.
    """
    import ctypes

    os.umask(0o077)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_NO_NEW_PRIVS) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError):  # not Linux: nothing to drop this way
        log.warning("prctl is not available here; the worker keeps its privileges")


def prepare() -> None:
    """Do the slow part of starting before any model is known: import TensorFlow and the detector.

    This creates no tensor and touches no device, so the memory policy applied later still takes effect.
    """
    from ..process import configure_cuda_order, quiet_tensorflow_startup, tensorflow_load_notices_dropped

    configure_cuda_order()
    quiet_tensorflow_startup()
    with tensorflow_load_notices_dropped():
        import tensorflow  # noqa: F401

        from ..inference import detector  # noqa: F401


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.models.worker")
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s worker[{os.getpid()}] %(name)s: %(message)s")
    from ..errors import DetectError
    from ..supervision import BOOT_ERROR
    from .channel import Channel, ChannelClosed

    # It maps the lanes' shared memory and runs native code: a crash prints every thread's stack.
    faulthandler.enable()
    drop_privileges()
    control = Channel(socket.socket(fileno=args.channel_fd))
    started = time.perf_counter()
    try:
        prepare()
    except Exception:  # the same on every try (a missing library, no temporary folder): a boot error
        log.exception("cannot start a worker: importing TensorFlow failed")
        return BOOT_ERROR
    try:
        control.send({"event": "spare", "pid": os.getpid(), "import_s": round(time.perf_counter() - started, 3)})
        header, _, fds = control.receive()
    except ChannelClosed:
        return 0
    if header.get("op") != "load":
        return 0
    worker = ModelWorker(control)
    name = _name(header)
    group = header.get("group")
    logging.getLogger().handlers[0].setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s worker[{os.getpid()} {'group ' + group if group else name}] %(name)s: %(message)s"))
    began = time.perf_counter()
    try:
        resident = worker.init_process(header, fds)
    except DetectError as exc:
        log.error("cannot load model %s: %s", name, exc.message)
        _say(control, {"event": "load_failed", "member": header.get("member"),
                       "error": {"code": exc.code, "message": exc.message}})
        return BOOT_ERROR
    except Exception as exc:  # a model that breaks the loader in a way of its own
        log.exception("cannot load model %s", name)
        _say(control, {"event": "load_failed", "member": header.get("member"),
                       "error": {"code": "invalid_model", "message": f"{type(exc).__name__}: {exc}"}})
        return BOOT_ERROR
    _say(control, {**resident.loaded_message(worker.policy), "seconds": round(time.perf_counter() - began, 3)})
    log.info("model %s loaded and warmed in %.2f s (%s)", name, time.perf_counter() - began, worker.policy.describe())
    return worker.run()


def _say(control, header: dict) -> None:
    from .channel import ChannelClosed

    try:
        control.send(header)
    except ChannelClosed:
        pass


if __name__ == "__main__":
    status = main()
    logging.shutdown()
    # TensorFlow's own threads can hold interpreter shutdown for seconds; there is nothing left to flush.
    os._exit(status)
