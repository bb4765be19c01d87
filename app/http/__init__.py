"""The HTTP front door: a Flask app (`app.http.app.create_app`) whose routes read requests into calls on the
data plane (app/protocol) and write the answers, and nothing else.

Importing this package imports no Flask.
"""
