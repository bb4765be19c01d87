"""The documentation site's build-time parts: the MkDocs hooks (hooks.py) and the settings reference."""
