"""One model resident in a worker process (the worker's side): its SavedModel, its precision, its lanes.

A worker of its own hosts one resident; a worker group's worker hosts one per member, and one more for
a member's new version while it takes over. A resident is loaded (load_detector), its precision settled
behind the parity gate in this process (app/inference/parity.py), warmed, and then serves the model
calls of its own lanes, a thread each. `release` ends it: its lanes are closed by the HTTP process, its
threads end, and its TensorFlow objects are dropped so that TensorFlow can free them; the memory goes
back to TensorFlow's allocator, where the other residents of the process may use it.

Precision is applied process-wide by TensorFlow (its graph optimizer's options): a resident's choice is
in force while it is loaded and warmed, which the HTTP process runs one member at a time per group.
"""

from __future__ import annotations

import gc
import logging
import socket
import threading
import time

log = logging.getLogger("app.worker")


class ResidentModel:
    """One model in this worker: load, serve its lanes, release; thread-safe where it says."""

    def __init__(self, member: str, model: dict):
        self.member = member  # the HTTP process's name for it: <model>/<version>#<n>
        self.model = model  # the `load` message's model: name, version, path, precision settings
        self.detector = None
        self.execution = None
        self._threads: list[threading.Thread] = []
        self._calls = threading.local()  # per lane: out-of-memory events in the call under way

    def load(self, memory_limit) -> None:
        """Load, settle the precision of and warm the model (the thread that loads); raise DetectError."""
        from ..inference.detector import load_detector
        from ..inference.parity import carry_over, settle_detector

        model = self.model
        self.detector = load_detector(model["path"], memory_limit=memory_limit, on_out_of_memory=self._out_of_memory)
        if model.get("settled"):  # this version's choice at an earlier load: its check is not repeated
            self.execution = carry_over(model["settled"])
        else:
            self.execution = settle_detector(self.detector, model.get("precision", "fp32"),
                                             bool(model.get("parity_gate", True)), float(model.get("threshold", 0.5)),
                                             int(model.get("max_image_pixels", 40_000_000)))
        (log.info if self.execution.gate != "failed" else log.warning)(
            "model %s executes in %s", model["name"], self.execution.describe())
        self.detector.warm_up()

    def loaded_message(self, policy) -> dict:
        """The `loaded` event the HTTP process waits for."""
        return {"event": "loaded", "member": self.member, "signature": self.detector.signature(),
                "signature_defs": self.detector.signature_defs(), "max_batch": self.detector.max_batch,
                "policy": policy.to_json(), "execution": self.execution.to_json()}

    def open_lanes(self, fds: list[int]) -> None:
        """Serve the lanes whose descriptors came with the load (socket, buffer, socket, buffer, ...)."""
        from .channel import Channel, SharedBuffer

        for i in range(len(fds) // 2):
            lane = Channel(socket.socket(fileno=fds[2 * i]))
            buffer = SharedBuffer(f"lane-{i}", fd=fds[2 * i + 1])
            thread = threading.Thread(target=self._serve_lane, args=(lane, buffer),
                                      name=f"lane-{self.model['name']}-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def release(self, timeout_s: float = 10.0) -> bool:
        """Wait for its lanes' threads to end (the HTTP process closed the lanes), then drop its TensorFlow objects.

        Return whether every lane thread ended in time; the objects are dropped either way.
        """
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        ended = not any(thread.is_alive() for thread in self._threads)
        self.detector = None
        gc.collect()
        return ended

    def _out_of_memory(self) -> None:
        self._calls.out_of_memory = getattr(self._calls, "out_of_memory", 0) + 1

    def _serve_lane(self, lane, buffer) -> None:
        """Answer the model calls of one lane, each exactly once, until the HTTP process closes it."""
        from .channel import ChannelClosed

        try:
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
        finally:
            lane.close()
            buffer.close()

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
