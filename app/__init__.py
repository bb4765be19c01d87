"""A GPU-sharing object-detection service: Flask on Twisted, with a GPU memory policy applied at boot."""

# The one place the version is written: pyproject.toml reads it (dynamic), and so do /v2, /openapi.json and
# `python -m app --version`. Each release adds its section to CHANGELOG.md under this number.
__version__ = "0.1.0"
