"""Video routes: POST /detect/video (the default model) and POST /models/<name>/detect/video.

The body is the video file itself (MP4, MOV, MKV or WebM), up to max_video_bytes: Twisted spools a large
body to a temporary file as it arrives, and the demuxer reads it there, in place. The answer streams as
the frames come back from the model: NDJSON, one record per line (the video, each sampled frame with its
tracked detections, the end, or an error), or with `Accept: video/mp4` (format=mp4) the video with its boxes
and track ids drawn. Everything that can refuse the video (a limit, a truncated file, the model) answers a
4xx or 503 before the first byte; later failures end the stream (app/protocol/video.py).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from typing import Iterator, Optional

from flask import Blueprint, Response, request

from ..errors import InvalidParameter, Unimplemented, UnsupportedContentType, VideoTooLarge
from ..protocol import context
from ..protocol.video import VideoOptions, start_video
from ..vision.video import VIDEO_TYPES, video_available
from .detect_request import media_type, parse_max_detections, parse_threshold
from .plane import plane

routes = Blueprint("video", __name__)

NDJSON = "application/x-ndjson"
ANSWERS = {NDJSON: "ndjson", "application/json": "ndjson", "video/mp4": "mp4"}
SPOOL_BYTES = 4 * 2**20  # a body that cannot be read in place is copied: in memory up to this, then to disk


@routes.post("/detect/video")
def video_default():
    return _video(plane().default_model())


@routes.post("/models/<name>/detect/video")
def video_model(name: str):
    return _video(plane().model(name))


def _video(model):
    """Check the request, start the video on `model` (refusing it whole if it must), and stream the answer."""
    data_plane = plane()
    settings = data_plane.settings
    options = parse_video_params(request.args, settings, _accepted())
    kind = media_type(request.content_type)
    if kind not in VIDEO_TYPES:
        raise UnsupportedContentType(f"Content-Type {kind or 'none'!r} is not accepted for a video; send the file as "
                                     f"{', '.join(VIDEO_TYPES[:4])} or application/octet-stream")
    if not video_available():
        raise Unimplemented("this server was installed without video support: pip install "
                            "'gpu-share-detect[video]' (PyAV)")
    length = request.content_length
    if length is not None and length > settings.max_video_bytes:
        raise VideoTooLarge(f"the request body is {length} bytes, over the limit of {settings.max_video_bytes} bytes "
                            "(max_video_bytes)")
    run = start_video(data_plane, model, _body(), options, context.current().cancellation)
    if options.annotated:
        response = Response(run.mp4(), mimetype="video/mp4")
    else:
        response = Response(_lines(run.records()), mimetype=NDJSON)
    response.call_on_close(run.close)
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Accel-Buffering"] = "no"  # a proxy that buffers answers (nginx) passes this one on as it comes
    response.vary.add("Accept")
    return response


def parse_video_params(args, settings, accepted: str) -> VideoOptions:
    """Parse threshold, max_detections, fps (above 0, at most max_video_fps) and format (ndjson or mp4)."""
    unknown = sorted(set(args) - {"threshold", "max_detections", "fps", "format"})
    if unknown:
        raise InvalidParameter(f"unknown query parameter {unknown[0]!r}; /detect/video takes threshold, "
                               "max_detections, fps and format")
    kind = args.get("format", accepted)
    if kind not in ("ndjson", "mp4"):
        raise InvalidParameter(f"format must be ndjson (tracked detections, one line per frame) or mp4 (the video "
                               f"with its boxes drawn), not {kind[:40]!r}")
    return VideoOptions(threshold=parse_threshold(args.get("threshold"), settings.default_threshold),
                        max_detections=parse_max_detections(args.get("max_detections")),
                        fps=_parse_fps(args.get("fps"), settings.max_video_fps), annotated=kind == "mp4")


def _parse_fps(raw: Optional[str], limit: float) -> Optional[float]:
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= limit):
        raise InvalidParameter(f"fps must be a number above 0 and at most {limit:g} (max_video_fps), not {raw[:40]!r}")
    return value


def _accepted() -> str:
    """The answer the Accept header prefers: ndjson (also for */* or none) or mp4."""
    best = request.accept_mimetypes.best_match(tuple(ANSWERS), default=NDJSON)
    return ANSWERS.get(best, "ndjson")


def _body():
    """The body as a seekable binary file: Twisted's own buffer or temporary file where the server runs on
    Twisted (app/hosting/wsgi.py), else a copy (another WSGI server, Flask's test client)."""
    stream = request.environ["wsgi.input"]
    if getattr(stream, "seekable", lambda: False)():
        return stream
    copy = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
    shutil.copyfileobj(request.stream, copy)
    return copy


def _lines(records) -> Iterator[bytes]:
    for record in records:
        yield (json.dumps(record, separators=(",", ":")) + "\n").encode()
