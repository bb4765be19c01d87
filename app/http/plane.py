"""How a route finds the data plane: the app it runs in holds it, so no route module imports app.py."""

from __future__ import annotations

from flask import current_app

from ..protocol.plane import DataPlane

EXTENSION = "dataplane"  # the key in app.extensions


def plane() -> DataPlane:
    """Return the data plane of the app handling the current request; called in WSGI request threads."""
    return current_app.extensions[EXTENSION]
