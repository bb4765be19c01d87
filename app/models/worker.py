"""What runs inside a model's worker process, and nothing else does: `python -m app.models.worker --channel-fd N`.

A worker starts as a spare: it imports TensorFlow (the slow part, about 3.5 s here), creates no tensor
and applies no memory policy, says `spare` on its control channel and waits. Given a model (`load`),
it applies that model's memory policy (TensorFlow's GPUs are still uninitialized, so the policy takes
effect), loads the model, settles its precision behind the parity gate (app/inference/parity.py),
warms it, says `loaded` with the signature and how it computes, and then serves model calls on its
lanes: each lane is a socket and a shared-memory buffer, served by a thread of its own, so that
`inference_threads` calls run at once. A load that fails says `load_failed` and exits with BOOT_ERROR.

The control channel also takes `stats` (TensorFlow's allocator figures) and `stop`. When the HTTP
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
from typing import Optional

log = logging.getLogger("app.worker")


class ModelWorker:
    """The worker's side: init_process (policy, load, warm-up), then run (lanes and control)."""

    def __init__(self, control):
        self.control = control
        self.detector = None
        self.policy = None
        self.execution = None
        self._lanes: list[threading.Thread] = []
        self._calls = threading.local()  # per lane: out-of-memory events in the call under way

    def init_process(self, request: dict, fds: list[int]) -> None:
        """Apply the model's memory policy, load and warm the model, open the lanes; raise DetectError."""
        from ..gpu.memory_policy import parse_gpu_list, parse_memory_spec
        from ..gpu.setup import setup_gpus
        from ..inference.detector import load_detector
        from ..inference.parity import carry_over, settle_detector
        from .channel import Channel, SharedBuffer

        model = request["model"]
        gpus = parse_gpu_list(model["gpus"])
        setup = setup_gpus(parse_memory_spec(model["gpu_memory"]), gpus)
        if setup.nvml is not None:
            setup.nvml.close()  # the HTTP process reads NVML; the worker only needed totals for a share
        self.policy = setup.policy
        self.detector = load_detector(model["path"], memory_limit=setup.policy.memory_limit(),
                                      on_out_of_memory=self._out_of_memory)
        if model.get("settled"):  # this version's choice at an earlier load: its check is not repeated
            self.execution = carry_over(model["settled"])
        else:
            self.execution = settle_detector(self.detector, model.get("precision", "fp32"),
                                             bool(model.get("parity_gate", True)), float(model.get("threshold", 0.5)),
                                             int(model.get("max_image_pixels", 40_000_000)))
        (log.info if self.execution.gate != "failed" else log.warning)(
            "model %s executes in %s", model["name"], self.execution.describe())
        self.detector.warm_up()
        lanes = len(fds) // 2
        for i in range(lanes):
            lane = Channel(socket.socket(fileno=fds[2 * i]))
            buffer = SharedBuffer(f"lane-{i}", fd=fds[2 * i + 1])
            thread = threading.Thread(target=self._serve_lane, args=(lane, buffer), name=f"lane-{i}", daemon=True)
            self._lanes.append(thread)

    def run(self) -> int:
        """Serve the lanes and the control channel until `stop` or the HTTP process goes away."""
        from .channel import ChannelClosed

        for thread in self._lanes:
            thread.start()
        while True:
            try:
                header, _, _ = self.control.receive()
            except ChannelClosed:
                log.info("the server closed the control channel; exiting")
                return 0
            op = header.get("op")
            if op == "stop":
                log.info("stopping on request")
                return 0
            if op == "stats":
                self.control.send({"event": "stats", "id": header.get("id"), "tensorflow": self._tensorflow_memory()})

    def _tensorflow_memory(self) -> list:
        if self.policy is None or not self.policy.gpus:
            return []
        from ..gpu.memory_policy import tensorflow_memory_info

        try:
            return tensorflow_memory_info()
        except Exception as exc:  # a report, never a reason to fail
            return [{"error": str(exc)}]

    def _out_of_memory(self) -> None:
        self._calls.out_of_memory = getattr(self._calls, "out_of_memory", 0) + 1

    def _serve_lane(self, lane, buffer) -> None:
        """Answer the model calls of one lane, each exactly once, until the HTTP process closes it."""
        from .channel import ChannelClosed

        while True:
            try:
                header, _, _ = lane.receive()
            except ChannelClosed:
                return
            received = time.monotonic()  # the clock the HTTP process's marks use too (app/timeline.py)
            self._calls.out_of_memory = 0
            errors, outputs = self._run_call(buffer, header["shape"])
            answered = time.monotonic()
            try:
                lane.send({"errors": errors, "seconds": answered - received, "received": received,
                           "answered": answered, "out_of_memory": self._calls.out_of_memory}, outputs)
            except ChannelClosed:
                return

    def _run_call(self, buffer, shape: list) -> tuple[list, dict]:
        """Run the batch in the lane's buffer; return per-image errors (None where it worked) and outputs.

        Whatever goes wrong is answered as every image's error: a call left unanswered would hold its
        request until the deadline.
        """
        from ..errors import DetectError
        from ..inference.detections import stack_outputs
        from .channel import BufferTooSmall

        try:
            batch = buffer.array(shape)
            results = self.detector.run_batch(batch)
            del batch
        except BufferTooSmall as exc:
            log.error("a model call did not fit its lane: %s", exc)
            return [{"code": "inference_failed", "message": "the batch did not reach the model whole"}] * shape[0], {}
        except Exception as exc:  # run_batch isolates the model's own failures; this is anything else
            log.exception("a model call failed")
            return [{"code": "inference_failed", "message": f"the model call failed: {type(exc).__name__}"}] * shape[0], {}
        errors = [{"code": r.code, "message": r.message} if isinstance(r, DetectError) else None for r in results]
        return errors, stack_outputs([r for r in results if not isinstance(r, DetectError)])


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
    name = f"{header['model']['name']}/{header['model']['version']}"
    logging.getLogger().handlers[0].setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s worker[{os.getpid()} {name}] %(name)s: %(message)s"))
    began = time.perf_counter()
    try:
        worker.init_process(header, fds)
    except DetectError as exc:
        log.error("cannot load model %s: %s", name, exc.message)
        _say(control, {"event": "load_failed", "error": {"code": exc.code, "message": exc.message}})
        return BOOT_ERROR
    except Exception as exc:  # a model that breaks the loader in a way of its own
        log.exception("cannot load model %s", name)
        _say(control, {"event": "load_failed", "error": {"code": "invalid_model",
                                                          "message": f"{type(exc).__name__}: {exc}"}})
        return BOOT_ERROR
    _say(control, {"event": "loaded", "signature": worker.detector.signature(),
                   "signature_defs": worker.detector.signature_defs(),
                   "max_batch": worker.detector.max_batch, "policy": worker.policy.to_json(),
                   "execution": worker.execution.to_json(),
                   "seconds": round(time.perf_counter() - began, 3)})
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
