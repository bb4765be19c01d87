"""The model behind KServe's Python model server (kserve 0.21): a `kserve.Model` served by `ModelServer`.

Speaks KServe's v1 protocol, as KServe's own custom-model sample does for images: POST
/v1/models/<name>:predict with `{"instances": [{"image": {"b64": "<the JPEG, base64>"}}]}`, answered with
`{"predictions": [<the service's JSON answer per image>]}`. (KServe 0.21's v2 REST binary extension cannot
carry a JPEG: it decodes every BYTES element as UTF-8 and answers 500.) KServe's Python server has no
batcher of its own (KServe's batcher is a sidecar of its Kubernetes deployment), so each request is one
model call.

    PYTHONPATH=. python benchmarks/peers/kserve/model.py --model_name shapes --model_dir models/shapes
        --http_port 8080 --enable_grpc false     (one line; from the repository's root, in the kserve venv)
"""

import argparse
import base64
import json
import kserve
from kserve import ModelServer, model_server

from benchmarks.peers.common import Model  # the same work for every peer (PYTHONPATH: the repository's root)


class Detector(kserve.Model):
    def __init__(self, name: str, model_dir: str):
        super().__init__(name)
        self.model_dir = model_dir
        self.model = None
        self.load()

    def load(self) -> bool:
        self.model = Model(self.model_dir)
        self.ready = True
        return self.ready

    def predict(self, payload: dict, headers=None) -> dict:
        jpegs = [base64.b64decode(instance["image"]["b64"]) for instance in payload["instances"]]
        return {"predictions": [json.loads(answer) for answer in self.model.answer(jpegs)]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(parents=[model_server.parser])
    parser.add_argument("--model_dir", required=True, help="a SavedModel base path or version folder")
    args, _ = parser.parse_known_args()
    ModelServer().start([Detector(args.model_name, args.model_dir)])
