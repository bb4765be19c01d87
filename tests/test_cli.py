"""The command line as a new user first meets it: --help for every command, --version, and every setting
named with its default in `serve --help`, in config/default.toml and in the settings reference."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
from conftest import ROOT

import app
from app.__main__ import COMMANDS, parser_of
from app.settings import default_text, env_name, flag_name, setting_fields
from tools.docs.settings_table import missing_from_config, settings_table


def run_app(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def squeezed(text: str) -> str:
    """The text without whitespace, so that argparse's line wrapping does not matter."""
    return "".join(text.split())


def test_the_top_level_help_lists_every_command_and_exits_0():
    result = run_app("--help")
    assert result.returncode == 0, result.stderr
    for name in COMMANDS:
        assert re.search(rf"^\s+{name}\s", result.stdout, re.MULTILINE), name
    assert "--version" in result.stdout


def test_no_command_or_an_unknown_one_prints_the_usage_and_exits_2():
    assert run_app().returncode == 2
    result = run_app("serv")
    assert result.returncode == 2 and "unknown command 'serv'" in result.stderr and "serve" in result.stderr


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_prints_its_help_and_exits_0(command):
    """`python -m app <command> --help` renders (a '%' in a help string once crashed serve's)."""
    result = run_app(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m app {command}"), result.stdout[:200]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_parser_formats_in_process_without_importing_tensorflow(command):
    """The CLI reference is generated from these parsers, so building them must stay cheap."""
    assert parser_of(command).format_help().startswith(f"usage: python -m app {command}")


def test_version_prints_the_one_version_that_v2_and_the_package_metadata_also_give():
    result = run_app("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"gpu-share-detect {app.__version__}"
    from app.protocol.plane import server_version

    assert server_version() == app.__version__
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "app.__version__"}


def test_the_changelog_starts_from_the_current_version():
    """Keep a Changelog: an Unreleased section, then the newest release, which is the version the code gives."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "keepachangelog.com" in changelog and "## [Unreleased]" in changelog
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.MULTILINE)
    assert releases and releases[0] == app.__version__, releases


def test_serve_help_gives_every_setting_with_its_default_and_variable():
    result = run_app("serve", "--help")
    assert result.returncode == 0, result.stderr
    shown = squeezed(result.stdout)
    for f in setting_fields():
        assert squeezed(f"{flag_name(f.name)} ") in shown, f.name
        line = f"{f.metadata['help']} (default: {default_text(f.name)}) [{env_name(f.name)}]"
        assert squeezed(line) in shown, f"serve --help lacks {f.name}'s line: {line}"


def test_config_default_toml_names_every_setting():
    text = (ROOT / "config" / "default.toml").read_text()
    assert missing_from_config(text) == [], "add them to config/default.toml (set, or in a commented-out line)"


def test_missing_from_config_finds_a_setting_the_file_leaves_out():
    text = (ROOT / "config" / "default.toml").read_text().replace("\nmax_queue =", "\nmax_queue_typo =")
    assert missing_from_config(text) == ["max_queue"]


def test_the_settings_reference_is_the_generated_table():
    """docs/reference/settings.md includes the table the hook renders from app/settings.py, nothing hand-written."""
    page = (ROOT / "docs" / "reference" / "settings.md").read_text()
    assert "<!-- generated: settings table -->" in page
    assert "| `host` |" not in page, "the table is generated at build time; do not paste it into the page"
    table = settings_table()
    for f in setting_fields():
        assert f"| `{f.name}` | `{env_name(f.name)}` | `{flag_name(f.name)}` |" in table


@pytest.mark.parametrize("page, command", [("docs/how-to/fleet.md", "fleet"), ("docs/how-to/calibrate.md", "calibrate")])
def test_a_how_to_flag_table_lists_exactly_the_flags_its_command_has(page, command):
    """The how-to guides explain each flag at more length than --help; they must name the same flags."""
    table = set(re.findall(r"^\| `(--[a-z-]+)", (ROOT / page).read_text(), re.MULTILINE))
    flags = {option for action in parser_of(command)._actions for option in action.option_strings
             if option.startswith("--") and option != "--help"}
    assert table == flags, f"{page}: missing {sorted(flags - table)}, not flags {sorted(table - flags)}"
