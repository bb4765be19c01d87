"""This service's own detection routes: POST /detect (the default model) and POST /models/<name>/detect.

Each answers JSON, or the image with its boxes drawn (format=jpeg or png, or an Accept header that prefers
image/jpeg or image/png). A picture answer carries the JSON answer in its `Detections` header, so a client
has both from one request: a header rather than a multipart body, so that the answer is a plain image any
viewer, <img> or `curl -o` takes as it is.
"""

from __future__ import annotations

import json
import time

from flask import Blueprint, Response, jsonify, request

from ..errors import InvalidBody, InvalidParameter
from ..inference.detections import to_detections
from ..protocol import context
from ..protocol.plane import detections_answer, image_answer
from ..vision.annotate import PICTURE_TYPES, draw_detections, encode_picture
from .detect_request import RAW_IMAGE_TYPES, check_raw_type, images_from_json, media_type, parse_params
from .plane import plane

# The Detections header holds the whole JSON answer up to this size; past it, the surest detections that fit
# (the picture shows every one). 12 KiB is about 110 detections, and leaves room under the 16 KiB of headers
# that Node's HTTP client takes by default (nginx's proxy_buffer_size is 4 or 8 KiB: docs/reference/annotated.md).
DETECTIONS_HEADER_BYTES = 12 * 2**10
ACCEPTED = {"image/jpeg": "jpeg", "image/png": "png"}

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
    params = parse_params(request.args, settings.default_threshold, _accepted())
    blobs, plural = _image_blobs(settings.max_images_per_request)
    if params.picture is not None and (plural or len(blobs) != 1):
        raise InvalidParameter(f"an answer drawn on the image (format={params.picture}) takes one image; this "
                               f"request has {len(blobs)}{' as a list' if plural else ''}")
    side = params.max_side if params.picture is not None else None
    run = data_plane.run_images(model, lambda: data_plane.decode_files(blobs, model, side), deadline)
    timing = {"decode": round(run.decode_s * 1000, 2)}
    if run.load_s > 0:
        timing["load"] = round(run.load_s * 1000, 2)
    timing["inference"] = round(run.inference_s * 1000, 2)
    timing["total"] = round(run.total_s * 1000, 2)
    if params.stages:
        timing["stages"] = context.timeline().ms()  # up to the answer: `encode` and `write` end after it is built
    labels = model.labels
    answer_model = {"name": model.name, "version": run.version}
    if params.picture is not None:
        return _picture_answer(answer_model, run, labels, params, timing)
    answers = [image_answer(image, out, labels, params.threshold, params.max_detections)
               for image, out in zip(run.images, run.outputs)]
    if len(answers) == 1 and not plural:
        response = jsonify({"model": answer_model, **answers[0], "timing_ms": timing})
    else:
        response = jsonify({"model": answer_model, "results": answers, "timing_ms": timing})
    response.vary.add("Accept")
    return response


def _accepted() -> str:
    """The answer the Accept header prefers: json (also for */* or none), jpeg or png."""
    best = request.accept_mimetypes.best_match(("application/json", *ACCEPTED), default="application/json")
    return ACCEPTED.get(best, "json")


def _picture_answer(answer_model: dict, run, labels: dict, params, timing: dict) -> Response:
    """Draw the detections on the image's picture and answer it, the JSON answer in the Detections header."""
    started = time.perf_counter()
    image, outputs = run.images[0], run.outputs[0]
    detections = to_detections(outputs, image.width, image.height, labels, params.threshold, params.max_detections)
    picture = image.picture
    draw_detections(picture, detections, scale=picture.width / image.width)
    body = encode_picture(picture, params.picture)
    timing["draw"] = round((time.perf_counter() - started) * 1000, 2)
    document = {"model": answer_model, **detections_answer(image, detections), "timing_ms": timing}
    response = Response(body, mimetype=PICTURE_TYPES[params.picture])
    response.headers["Detections"] = detections_header(document)
    response.vary.add("Accept")
    return response


def detections_header(document: dict, limit: int = DETECTIONS_HEADER_BYTES) -> str:
    """The JSON answer as one header value (ASCII); over `limit`, the surest detections that fit, and
    `detections_omitted` says how many were left out."""
    text = json.dumps(document, separators=(",", ":"))
    detections = document["detections"]
    if len(text) <= limit:
        return text
    low, high = 0, len(detections)  # the most detections (surest first, as they come) whose answer fits
    while low < high:
        middle = (low + high + 1) // 2
        trial = {**document, "detections": detections[:middle], "detections_omitted": len(detections) - middle}
        if len(json.dumps(trial, separators=(",", ":"))) <= limit:
            low = middle
        else:
            high = middle - 1
    return json.dumps({**document, "detections": detections[:low], "detections_omitted": len(detections) - low},
                      separators=(",", ":"))


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
