"""The HTTP layer: a Flask app whose routes parse, call the model registry, and serialize."""

from .app import create_app

__all__ = ["create_app"]
