"""The model behind MLServer (1.7): a custom inference runtime, `MLModel`, with MLServer's adaptive batching.

The v2 protocol as MLServer's docs recommend for binary data: POST /v2/models/<name>/infer with the JPEG
base64 in the BYTES input `image`, marked `"parameters": {"content_type": "base64"}` (decoded by
MLServer's Base64Codec); the answer is the BYTES output `detections`, the service's JSON per image.
Adaptive batching is set in model-settings.json (`max_batch_size` 16, `max_batch_time` 0.005 s), which
benchmarks/peers/compare.py writes next to settings.json before `mlserver start <folder>`.
"""

from mlserver import MLModel
from mlserver.codecs import Base64Codec
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput

from benchmarks.peers.common import Model  # PYTHONPATH: the repository's root


class Detector(MLModel):
    async def load(self) -> bool:
        self.model = Model(self.settings.parameters.uri)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        jpegs = Base64Codec.decode_input(payload.inputs[0])
        answers = self.model.answer(jpegs)
        output = ResponseOutput(name="detections", shape=[len(answers)], datatype="BYTES", data=answers)
        return InferenceResponse(model_name=self.name, id=payload.id, outputs=[output])
