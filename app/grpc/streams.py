"""ModelStreamInfer's streams: each request run at once on a pool of the streams' own, answered on its stream.

A stream is admitted, held and ended when idle by app/grpc/calls.py like any call a client holds open; here
are what its requests do. At most `limit` requests (http_threads) are read ahead of their answers across every
stream together: a stream's reader waits for room before it reads the next, so a client that floods its streams
is slowed by gRPC's flow control, never buffered here. Each request passes the data plane's admission as a
unary call does (app/grpc/kserve.py). The stream's client and cancellation (its request context, opened by
the interceptor) go with each of its requests: a stream that ends drops what its requests still have queued.
Thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ..protocol import context as request_context
from ..protocol.context import RequestContext

log = logging.getLogger(__name__)

# answer(request, grpc context, the stream's request context) -> the message to send; never raises.
Answer = Callable[[object, object, RequestContext], object]


class Streams:
    """The requests of every open stream: read ahead within a bound, run on a pool of their own."""

    _READ_ALL = object()  # the reader's last word: every request of the stream has been handed out

    def __init__(self, limit: int):
        self._room = threading.Semaphore(limit)
        self._pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="grpc-stream-request")

    def serve(self, requests, context, answer: Answer):
        """Yield `answer(request, context, stream)` for each request of the stream as it finishes, until the client
        has sent its last request and every answer is out, or until the client goes away."""
        stream = request_context.current()
        answers: queue.SimpleQueue = queue.SimpleQueue()
        gone = stream.cancellation
        gone.on_cancel(lambda: answers.put(self._READ_ALL))  # wake the answers' loop: nobody reads them now

        def run(request):
            try:
                answers.put(answer(request, context, stream))
            finally:
                self._room.release()

        def read():
            count = 0
            try:
                for request in requests:
                    while not self._room.acquire(timeout=0.5):
                        if gone.cancelled:
                            return
                    if gone.cancelled:
                        self._room.release()
                        return
                    try:
                        self._pool.submit(run, request)
                    except RuntimeError:  # the pool has shut down: the server is stopping
                        self._room.release()
                        return
                    count += 1
            except Exception as exc:  # the client cancelled, or the connection broke, while we read
                log.debug("a stream ended while reading: %s", exc)
            finally:
                answers.put((self._READ_ALL, count))

        threading.Thread(target=read, name="grpc-stream-reader", daemon=True).start()
        sent, total = 0, None
        while total is None or sent < total:
            item = answers.get()
            if gone.cancelled:
                return
            if isinstance(item, tuple) and item and item[0] is self._READ_ALL:
                total = item[1]
                continue
            yield item
            sent += 1

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
