"""The page: GET / and its files, plain HTML, CSS and JavaScript kept in the package (app/http/static/).

It needs no build step and speaks only to this service's own JSON routes: /models, /models/<name>/detect,
/gpu, /gpu/history and the repository extension's load and unload. Only the files named here are
served, revalidated on each load (ETag) so that a new release shows at once.
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, send_from_directory

from ..errors import NotFound

STATIC = Path(__file__).resolve().parent / "static"
FILES = {
    "page.css": "text/css",
    "page.js": "text/javascript",
    "favicon.svg": "image/svg+xml",
}

routes = Blueprint("page", __name__)


@routes.get("/")
def index():
    return send_from_directory(STATIC, "index.html", mimetype="text/html", max_age=0)


@routes.get("/static/<name>")
def static_file(name: str):
    mimetype = FILES.get(name)
    if mimetype is None:
        raise NotFound(f"no file /static/{name[:100]}; the page's files are {', '.join(sorted(FILES))}")
    return send_from_directory(STATIC, name, mimetype=mimetype, max_age=0)
