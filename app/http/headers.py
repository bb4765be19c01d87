"""Headers every answer carries: a Content-Security-Policy that allows only this origin, and CORS for listed origins.

The page (app/http/page.py) loads its script, style and data from this origin alone, so the policy
allows nothing else: no inline script or style, no other host, no framing. Images the user picks are
shown from `blob:` URLs the page makes itself, and so is a video file it plays back with its tracks. The API sends no CORS headers unless `cors_origins`
lists the calling page's origin; then that origin (never `*`) may call it, preflight included.
Answers the Twisted site writes itself (overload, shutdown, an over-long body) carry the same
security headers through error_answer.
"""

from __future__ import annotations

from flask import Flask, Response, request

CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' blob:",
    "media-src 'self' blob:",
    "connect-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'self'",
    "frame-ancestors 'none'",
))
SECURITY_HEADERS = (
    ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
    ("X-Content-Type-Options", "nosniff"),
)
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = ("content-type",)  # the only request header a browser needs to send the API its images
CORS_MAX_AGE_S = 600


def install_headers(app: Flask, cors_origins: tuple[str, ...]) -> None:
    """Add the security headers to every answer, and answer CORS for `cors_origins` only."""
    allowed = frozenset(cors_origins)

    def preflight():
        origin = request.headers.get("Origin")
        if request.method != "OPTIONS" or origin not in allowed \
                or "Access-Control-Request-Method" not in request.headers:
            return None
        asked = [h.strip().lower() for h in request.headers.get("Access-Control-Request-Headers", "").split(",")]
        response = Response(status=204)
        response.headers["Access-Control-Allow-Methods"] = CORS_METHODS
        granted = [h for h in asked if h in CORS_HEADERS]
        if granted:
            response.headers["Access-Control-Allow-Headers"] = ", ".join(granted)
        response.headers["Access-Control-Max-Age"] = str(CORS_MAX_AGE_S)
        return response

    def finish(response: Response) -> Response:
        for name, value in SECURITY_HEADERS:
            response.headers[name] = value
        if allowed:
            response.vary.add("Origin")
            origin = request.headers.get("Origin")
            if origin in allowed:
                response.headers["Access-Control-Allow-Origin"] = origin
                response.headers["Access-Control-Expose-Headers"] = "Retry-After, Detections"
        return response

    app.before_request(preflight)
    app.after_request(finish)
