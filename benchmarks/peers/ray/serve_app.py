"""The model behind Ray Serve (ray 2.60): one deployment, `@serve.batch` to batch requests, plain HTTP.

POST the JPEG as the request body to http://127.0.0.1:<port>/detect; the answer is the service's JSON. As
Ray Serve's docs recommend for batching: an async batch method with `@serve.batch(max_batch_size=16,
batch_wait_timeout_s=0.005)`, called once per request. `max_ongoing_requests` is raised from its default
of 5 to 64, or a batch could never hold more than 5 images and requests would queue in the proxy.

    PYTHONPATH=. python benchmarks/peers/ray/serve_app.py --model models/shapes --port 8000
        (from the repository's root, in the ray venv; runs until SIGTERM or SIGINT)
"""

import argparse
import signal
import threading

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from benchmarks.peers.common import Model  # PYTHONPATH: the repository's root, for Ray's workers too

MAX_BATCH_SIZE = 16
BATCH_WAIT_TIMEOUT_S = 0.005
MAX_ONGOING_REQUESTS = 64


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS)
class Detector:
    def __init__(self, model_dir: str):
        self.model = Model(model_dir)

    @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_TIMEOUT_S)
    async def answer(self, jpegs: list[bytes]) -> list[str]:
        return self.model.answer(jpegs)

    async def __call__(self, request: Request) -> Response:
        return Response(await self.answer(await request.body()), media_type="application/json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a SavedModel base path or version folder")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    ray.init(include_dashboard=False)  # the dashboard serves people, not requests
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(Detector.bind(args.model), name="detector", route_prefix="/detect")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print("ready", flush=True)
    stop.wait()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
