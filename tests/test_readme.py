"""The README is the user's manual: its settings table is the one the code defines."""

from __future__ import annotations

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

from settings_table import settings_table  # noqa: E402


def test_the_readme_lists_every_setting_with_its_env_name_flag_and_default():
    readme = (ROOT / "README.md").read_text()
    assert settings_table() in readme, "regenerate the table: python scripts/settings_table.py"


def test_the_readme_shows_a_curl_example_for_every_route():
    readme = (ROOT / "README.md").read_text()
    for route in ("/detect", "/gpu", "/healthz", "/readyz", "/metrics"):
        assert f"localhost:8000{route}" in readme, route
