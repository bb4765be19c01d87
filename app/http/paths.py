"""What a request path is, decided before the app runs it: its protocol, and the model it asks to run.

The Twisted site reads these in the I/O thread to admit or refuse inference requests, and to write a
refusal in the protocol's own shape, without running the app.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

DETECT, V2, V1 = "detect", "v2", "v1"
DEFAULT_MODEL = ""  # the model POST /detect names: the registry's default model


class Target(NamedTuple):
    """What an inference request runs: its route, as the app's rule names it, and its model."""

    route: str
    model: str  # DEFAULT_MODEL for /detect


_INFERENCE = (  # each route as the app's rule names it, for the request metrics
    ("/detect", re.compile(r"^/detect$")),
    ("/models/<name>/detect", re.compile(r"^/models/(?P<name>[^/]+)/detect$")),
    ("/detect/video", re.compile(r"^/detect/video$")),
    ("/models/<name>/detect/video", re.compile(r"^/models/(?P<name>[^/]+)/detect/video$")),
    ("/v2/models/<name>/infer", re.compile(r"^/v2/models/(?P<name>[^/]+)/infer$")),
    ("/v2/models/<name>/versions/<version>/infer", re.compile(r"^/v2/models/(?P<name>[^/]+)/versions/[^/]+/infer$")),
    ("/v1/models/<name>:predict", re.compile(r"^/v1/models/(?P<name>[^/]+):predict$")),
    ("/v1/models/<name>/versions/<version>:predict",
     re.compile(r"^/v1/models/(?P<name>[^/]+)/versions/[^/]+:predict$")),
)


def protocol_of(path: str) -> str:
    """Return the protocol a request path belongs to, which decides its error shape."""
    if path == "/v2" or path.startswith("/v2/"):
        return V2
    if path.startswith("/v1/"):
        return V1
    return DETECT


def inference_target(path: str) -> Optional[Target]:
    """Return the route and model an inference path asks for, or None if it runs no model.

    `path` is as the app routes it, its segments unquoted (WSGI's PATH_INFO; app/hosting/site.py's app_path),
    so that an escaped path is the route it becomes, not a way past admission."""
    for route, pattern in _INFERENCE:
        found = pattern.match(path)
        if found:
            return Target(route, found.groupdict().get("name") or DEFAULT_MODEL)
    return None


VIDEO_ROUTES = ("/detect/video", "/models/<name>/detect/video")  # bodies up to max_video_bytes, not max_body_bytes


def is_video(path: str) -> bool:
    """Whether a request path is a video route, whose body may be up to max_video_bytes."""
    target = inference_target(path)
    return target is not None and target.route in VIDEO_ROUTES
