"""Dynamic batching: answers go back to their request and position; bounds, deadlines and memory errors."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from app.errors import DeadlineExceeded, InferenceFailed, Overloaded, OutOfMemory
from app.inference.batcher import InferenceQueue
from app.inference.detections import to_detections
from app.inference.detector import Detector, load_detector

from blob_model import blob_image
from conftest import running_registry
from images_for_tests import encode


def _case(i: int):
    """Image i and the boxes it must come back with: sizes and blobs vary with i."""
    width, height = (64, 48) if i % 3 else (40, 40)
    x = i % 20
    blobs = {1: (x, 1, x + 5, 6)}
    if i % 2:
        blobs[3] = (30, 20, 36, 30 + i % 7)
    return blob_image(width, height, blobs), blobs


def _as_tuples(found):
    return {d.class_id: (d.box.x_min, d.box.y_min, d.box.x_max, d.box.y_max) for d in found}


def _calls(metrics, model: str) -> tuple[float, float, float]:
    """Return (model calls, calls of one image, calls of up to 8) from the batch-size histogram."""
    text = metrics.render().decode()

    def value(series):
        found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    name = "detect_images_per_model_call"
    return (value(f'{name}_count{{model="{model}"}}'), value(f'{name}_bucket{{le="1.0",model="{model}"}}'),
            value(f'{name}_bucket{{le="8.0",model="{model}"}}'))


def test_concurrent_mixed_requests_each_get_their_own_answers_in_order(blob_model_dir):
    with running_registry(blob_model_dir, spare_workers=0, max_batch_size=8, max_batch_delay_ms=20,
                          inference_threads=1) as registry:
        model = registry.get("blob")

        def one_request(r: int):
            cases = [_case(r * 3 + k) for k in range(1 + r % 3)]
            outputs = model.detect_outputs([image for image, _ in cases], time.monotonic() + 60)
            return [(_as_tuples(to_detections(out, image.shape[1], image.shape[0], {}, 0.1, 10)), blobs)
                    for out, (image, blobs) in zip(outputs, cases)]

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one_request, range(48)))
        calls, single, up_to_8 = _calls(registry.metrics, "blob")
    for request in answers:
        for got, blobs in request:
            assert got.keys() == blobs.keys()
            for class_id, box in blobs.items():
                assert got[class_id] == pytest.approx(box, abs=1e-3)
    assert single < calls, "concurrent same-sized images should have shared model calls"
    assert up_to_8 == calls


def test_a_batch_one_model_is_never_batched_even_under_load(blob_batch1_dir):
    with running_registry(blob_batch1_dir, spare_workers=0, max_batch_size=8, max_batch_delay_ms=5,
                          inference_threads=2) as registry:
        model = registry.get("blob1")
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: model.detect_outputs([_case(i)[0]] * 2, time.monotonic() + 60),
                                    range(16)))
        calls, single, _ = _calls(registry.metrics, "blob1")
    assert calls == single == 32
    assert all(len(r) == 2 for r in results)


class _Gate:
    """A run_batch that blocks until released, to hold the queue still."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = []

    def __call__(self, images, deadline, call):
        self.calls.append(len(images))
        self.release.wait(10)
        return [f"answer-{int(image[0, 0, 0])}" for image in images]


def _tagged(tag: int):
    return np.full((4, 4, 3), tag, np.uint8)


def _submit_elsewhere(queue: InferenceQueue, images, deadline: float) -> Future:
    """Submit from a thread of its own: a lone request makes its call in the submitting thread, which the
    gate holds. The returned future gives the submitted images' futures once the call is over."""
    submitting: Future = Future()

    def submit():
        submitting.set_result(queue.submit(images, deadline))

    threading.Thread(target=submit, daemon=True).start()
    time.sleep(0.1)  # it is running (and blocks on the gate) by now
    return submitting


def test_a_full_queue_refuses_at_once_and_nothing_accepted_is_lost():
    gate = _Gate()
    queue = InferenceQueue(gate, max_batch=2, max_delay_s=0, threads=1, max_queue=3)
    far = time.monotonic() + 60
    first = _submit_elsewhere(queue, [_tagged(1)], far)
    accepted = queue.submit([_tagged(2), _tagged(3), _tagged(4)], far)
    with pytest.raises(Overloaded, match="queue is full"):
        queue.submit([_tagged(5)], far)
    gate.release.set()
    assert [f.result(5) for f in first.result(5) + accepted] == ["answer-1", "answer-2", "answer-3", "answer-4"]
    queue.close()
    assert gate.calls == [1, 2, 1]


def test_an_image_whose_deadline_passed_is_answered_not_run():
    gate = _Gate()
    queue = InferenceQueue(gate, max_batch=1, max_delay_s=0, threads=1, max_queue=10)
    blocker = _submit_elsewhere(queue, [_tagged(1)], time.monotonic() + 60)
    late = queue.submit([_tagged(2)], time.monotonic() + 0.05)
    time.sleep(0.2)
    gate.release.set()
    assert blocker.result(5)[0].result(5) == "answer-1"
    with pytest.raises(DeadlineExceeded):
        late[0].result(5)
    queue.close()
    assert gate.calls == [1]


def test_a_lone_request_makes_its_call_in_its_own_thread_and_a_busy_queue_batches():
    threads, running, most = [], [0], [0]
    lock = threading.Lock()

    def run_batch(images, deadline, call):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        threads.append(threading.current_thread().name)
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return [f"answer-{int(image[0, 0, 0])}" for image in images]

    queue = InferenceQueue(run_batch, max_batch=8, max_delay_s=0, threads=2, max_queue=100)
    far = time.monotonic() + 60
    assert [f.result(5) for f in queue.submit([_tagged(7)], far)] == ["answer-7"]
    assert threads == [threading.current_thread().name]  # no batching thread took part
    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(lambda i: [f.result(10) for f in queue.submit([_tagged(i)], far)], range(96)))
    queue.close()
    assert answers == [[f"answer-{i}"] for i in range(96)]
    assert most[0] <= 2, "never more calls at once than inference_threads, whoever makes them"
    assert len(threads) < 97, "requests that found others waiting shared calls"
    assert any(name.startswith("inference-") for name in threads)


def test_a_stopped_worker_costs_its_requests_their_deadline_not_the_server(app_factory, slow_blob_model_dir):
    """A worker frozen (SIGSTOP) past the deadline: each request gets 504 at its deadline, none hangs; once it
    runs again, the late answers free its lanes and the next request is answered."""
    import os
    import signal

    with running_registry(slow_blob_model_dir, spare_workers=0, inference_threads=2) as registry:
        client = app_factory(models=registry, request_deadline_s=2.0).test_client()
        worker = registry.get("slowblob").worker
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(4) as pool:
                started = time.monotonic()
                answers = list(pool.map(lambda _: client.post("/detect", data=encode(blob_image(8, 8, {})),
                                                              content_type="image/png"), range(4)))
                took = time.monotonic() - started
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert [a.status_code for a in answers] == [504] * 4
        assert took < 8.0, f"requests waited {took:.1f} s for a frozen worker with a 2 s deadline"
        patient = app_factory(models=registry, request_deadline_s=30.0).test_client()  # the late calls run first
        after = patient.post("/detect", data=encode(blob_image(8, 8, {})), content_type="image/png")
        assert after.status_code == 200, after.json
        assert registry.get("slowblob").worker is worker, "a frozen worker that came back is not restarted"


def test_the_request_gets_504_when_its_deadline_passes_while_waiting(app_factory, slow_blob_model_dir):
    with running_registry(slow_blob_model_dir, spare_workers=0) as registry:
        client = app_factory(models=registry, request_deadline_s=0.3).test_client()
        response = client.post("/detect", data=encode(blob_image(8, 8, {})), content_type="image/png")
    assert response.status_code == 504 and response.json["error"]["code"] == "deadline_exceeded"


def test_a_request_whose_images_do_not_fit_the_queue_gets_503_with_retry_after(app_factory, slow_blob_model_dir):
    with running_registry(slow_blob_model_dir, spare_workers=0, max_queue=1, max_batch_size=1,
                          inference_threads=1) as registry:
        model = registry.get("slowblob")
        far = time.monotonic() + 60
        running = _submit_elsewhere(model.queue, [_tagged(1)], far)  # the one call that may run
        time.sleep(0.2)
        waiting = model.queue.submit([_tagged(2)], far)  # fills the queue
        client = app_factory(models=registry).test_client()
        response = client.post("/detect", data=encode(blob_image(8, 8, {})), content_type="image/png")
        for future in running.result(60) + waiting:
            future.result(60)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    assert response.json["error"]["code"] == "overloaded"


PIXEL_BUDGET = 150_000  # the hungry model asks for 4 TiB once a call holds more pixels than this (warm-up fits)


@pytest.fixture(scope="module")
def hungry_model_dir(tmp_path_factory):
    """A detector that allocates beyond any machine's memory when one call carries too many pixels."""
    import tensorflow as tf

    class Hungry(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8, name="input_tensor")])
        def detect(self, input_tensor):
            shape = tf.shape(input_tensor, out_type=tf.int64)
            pixels = shape[0] * shape[1] * shape[2]
            size = tf.where(pixels > PIXEL_BUDGET, tf.constant(2**40, tf.int64), tf.constant(1, tf.int64))
            spent = tf.reduce_max(tf.random.uniform(tf.reshape(size, [1]))) * 0.0
            batch = shape[0]
            return {
                "detection_boxes": tf.zeros(tf.stack([batch, 1, 4])) + spent,
                "detection_scores": tf.ones(tf.stack([batch, 1])) * 0.9,
                "detection_classes": tf.ones(tf.stack([batch, 1])),
                "num_detections": tf.ones(tf.reshape(batch, [1])),
            }

    module = Hungry()
    path = tmp_path_factory.mktemp("models") / "hungry" / "1"
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.detect})
    return path


def test_a_batch_that_runs_out_of_memory_is_retried_in_halves(hungry_model_dir):
    calls, ooms = [], []
    detector = load_detector(hungry_model_dir, on_model_call=lambda n, s: calls.append(n),
                             on_out_of_memory=lambda: ooms.append(1), memory_limit="the GPU memory cap of 64 MiB")
    batch = np.zeros((4, 283, 283, 3), np.uint8)  # 80089 pixels each: one fits, two do not
    results = detector.run_batch(batch)
    assert len(results) == 4 and all(not isinstance(r, Exception) for r in results)
    assert calls == [1, 1, 1, 1] and len(ooms) == 3  # 4 -> 2 + 2 -> 1 + 1 + 1 + 1


def test_one_image_that_alone_runs_out_of_memory_gets_an_error_naming_the_cap(hungry_model_dir):
    detector = load_detector(hungry_model_dir, memory_limit="the GPU memory cap of 64 MiB")
    (result,) = detector.run_batch(np.zeros((1, 400, 400, 3), np.uint8))
    assert isinstance(result, OutOfMemory) and "the GPU memory cap of 64 MiB" in result.message


def test_out_of_memory_over_http_is_503_and_the_worker_keeps_serving(hungry_model_dir, app_factory):
    with running_registry(hungry_model_dir, spare_workers=0) as registry:
        client = app_factory(models=registry).test_client()
        big = client.post("/detect", data=encode(blob_image(400, 400, {})), content_type="image/png")
        small = client.post("/detect", data=encode(blob_image(20, 20, {})), content_type="image/png")
        metrics = client.get("/metrics").get_data(as_text=True)
    assert big.status_code == 503 and big.json["error"]["code"] == "out_of_memory"
    assert "on this image alone" in big.json["error"]["message"]
    assert small.status_code == 200
    assert 'detect_out_of_memory_total{model="hungry"} 1.0' in metrics


class _Unlucky:
    """Detector.run_batch's splitting, over a run that fails on any batch holding the tag 13."""

    _tf = __import__("tensorflow")
    _on_out_of_memory = None
    memory_limit = "none"
    run_batch = Detector.run_batch

    def __init__(self):
        self.calls = []

    def run(self, batch):
        self.calls.append(batch.shape[0])
        if 13 in batch[:, 0, 0, 0]:
            raise ValueError("13 is unlucky")
        return [f"ok-{int(b[0, 0, 0])}" for b in batch]


def test_one_failing_image_in_a_batch_fails_alone():
    model = _Unlucky()
    results = model.run_batch(np.stack([_tagged(t) for t in (1, 13, 3, 4)]))
    assert results[0] == "ok-1" and results[2:] == ["ok-3", "ok-4"]
    assert isinstance(results[1], InferenceFailed)
    assert model.calls == [4, 2, 1, 1, 2]
