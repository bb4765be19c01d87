"""The HTTP layer: a Flask app (`app.http.app.create_app`) whose routes parse, call the model registry, and serialize.

Importing this package imports no Flask: the settings parse access rules from `app.http.access`, and the
fleet and the GPU check read settings where the HTTP stack is not installed.
"""
