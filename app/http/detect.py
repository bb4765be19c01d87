"""This service's own detection routes: POST /detect (the default model) and POST /models/<name>/detect."""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from ..errors import InvalidBody
from ..protocol import context
from ..protocol.plane import image_answer
from .detect_request import RAW_IMAGE_TYPES, check_raw_type, images_from_json, media_type, parse_params
from .plane import plane

routes = Blueprint("detect", __name__)


@routes.post("/detect")
def detect_default():
    return _detect(plane().default_model())


@routes.post("/models/<name>/detect")
def detect_model(name: str):
    return _detect(plane().model(name))


def _detect(model):
    """Decode the request's images, run them on `model`, and answer with labelled pixel boxes."""
    data_plane = plane()
    settings = data_plane.settings
    deadline = data_plane.deadline()
    params = parse_params(request.args, settings.default_threshold)
    blobs, plural = _image_blobs(settings.max_images_per_request)
    run = data_plane.run_images(model, lambda: data_plane.decode_files(blobs, model), deadline)
    timing = {"decode": round(run.decode_s * 1000, 2)}
    if run.load_s > 0:
        timing["load"] = round(run.load_s * 1000, 2)
    timing["inference"] = round(run.inference_s * 1000, 2)
    timing["total"] = round(run.total_s * 1000, 2)
    if params.stages:
        timing["stages"] = context.timeline().ms()  # up to the answer: `encode` and `write` end after it is built
    labels = model.labels
    answers = [image_answer(image, out, labels, params.threshold, params.max_detections)
               for image, out in zip(run.images, run.outputs)]
    answer_model = {"name": model.name, "version": run.version}
    if len(answers) == 1 and not plural:
        return jsonify({"model": answer_model, **answers[0], "timing_ms": timing})
    return jsonify({"model": answer_model, "results": answers, "timing_ms": timing})


def _image_blobs(limit: int) -> tuple[list[bytes], bool]:
    """Return the request's image bytes, and whether the client sent a list ("images")."""
    kind = media_type(request.content_type)
    check_raw_type(kind)
    plural = False
    if kind in RAW_IMAGE_TYPES:
        blobs = [request.get_data(cache=False)]
    elif kind == "multipart/form-data":
        files = request.files.getlist("image")
        if not files:
            fields = sorted(set(request.files) | set(request.form))
            raise InvalidBody(
                "the multipart body has no 'image' file field"
                + (f" (it has {', '.join(repr(f) for f in fields[:5])})" if fields else "")
            )
        blobs = [f.read() for f in files]
    else:
        blobs, plural = images_from_json(request.get_data(cache=False))
    if len(blobs) > limit:
        raise InvalidBody(f"the request has {len(blobs)} images; at most {limit} are accepted")
    return blobs, plural
