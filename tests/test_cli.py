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
from app.hosting.serve import parse_flags
from app.settings import (SETTING_GROUPS, default_text, env_name, flag_name, load_settings, setting_fields,
                          value_text)
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


def test_serve_help_gives_every_setting_with_its_effective_default_and_variable():
    """The defaults shown are those config/default.toml leads to, and say where a file changed one."""
    result = run_app("serve", "--help")
    assert result.returncode == 0, result.stderr
    shown = squeezed(result.stdout)
    effective = load_settings(config_path=ROOT / "config" / "default.toml", environ={})
    for f in setting_fields():
        assert squeezed(f"{flag_name(f.name)}") in shown, f.name
        value = getattr(effective, f.name)
        default = default_text(f.name) if value == f.default else f"{value_text(f.name, value)}, from config/default.toml"
        line = f"{f.metadata['help']} (default: {default}) [{env_name(f.name)}]"
        assert squeezed(line) in shown, f"serve --help lacks {f.name}'s line: {line}"
    assert squeezed("(default: objects, from config/default.toml) [DETECT_DEFAULT_MODEL]") in shown  # not the code's ""


def test_serve_help_shows_the_defaults_of_the_given_config_file_and_never_a_secret(tmp_path):
    config = tmp_path / "mine.toml"
    config.write_text('max_queue = 7\npreload = false\nrestricted_api = "model-repository:x-key=hunter2"\n')
    result = run_app("serve", "--config", str(config), "--help")
    assert result.returncode == 0, result.stderr
    shown = squeezed(result.stdout)
    assert squeezed(f"(default: 7, from {config}) [DETECT_MAX_QUEUE]") in shown
    assert squeezed(f"(default: false, from {config}) [DETECT_PRELOAD]") in shown
    assert squeezed(f"(default: set in {config}) [DETECT_RESTRICTED_API]") in shown
    assert "hunter2" not in result.stdout
    assert squeezed("(default: \"\") [DETECT_DEFAULT_MODEL]") in shown  # this file, not config/default.toml


def test_serve_help_with_a_bad_config_file_still_prints_and_says_the_defaults_are_the_codes(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("max_queue = -1\n")
    result = run_app("serve", "--config", str(config), "--help")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert squeezed(f"Defaults shown: the code's (setting DETECT_MAX_QUEUE (--max-queue), from max_queue in {config}") \
        in squeezed(result.stdout)
    assert squeezed("(default: 128) [DETECT_MAX_QUEUE]") in squeezed(result.stdout)


def sections(help_text: str) -> dict[str, list[str]]:
    """The flags under each section heading of an argparse help text."""
    found: dict[str, list[str]] = {}
    current = None
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = found.setdefault(line[:-1], [])
        elif current is not None and line.startswith("  --"):
            current.append(line.split()[0].rstrip(","))
    return found


def test_serve_help_groups_the_settings_in_the_sections_and_order_of_the_settings_reference():
    result = run_app("serve", "--help")
    found = sections(result.stdout)
    titles = [title for title, _ in SETTING_GROUPS]
    assert [t for t in found if t in titles] == titles, list(found)
    for title, names in SETTING_GROUPS:
        assert found[title] == [flag_name(name) for name in names], title
    assert re.findall(r"^### (.+)$", settings_table(), re.MULTILINE) == titles
    grouped = [name for _, names in SETTING_GROUPS for name in names]
    assert sorted(grouped) == sorted(f.name for f in setting_fields()), "every setting in exactly one section"


def test_boolean_settings_are_flags_with_no_forms_and_no_value_placeholder():
    text = parser_of("serve").format_help()
    booleans = [f.name for f in setting_fields() if isinstance(f.default, bool)]
    assert set(booleans) == {"decode_at_model_size", "preload", "parity_gate", "shared_memory_same_owner"}
    for name in booleans:
        flag = flag_name(name)
        assert f"{flag}, --no-{flag[2:]}" in text, name
        assert not re.search(rf"{flag} [A-Z]", text), f"{flag} shows a value placeholder"
    assert parse_flags(["--no-preload"])[1]["preload"] is False
    assert parse_flags(["--preload"])[1]["preload"] is True
    assert parse_flags([])[1]["preload"] is None  # not given: the file or the environment decides


@pytest.mark.parametrize("argv, expected", [
    (["--decode-at-model-size", "false"], False), (["--decode-at-model-size=off"], False),
    (["--decode-at-model-size", "yes"], True), (["--decode-at-model-size", "--port", "9"], True),
])
def test_the_older_spelling_of_a_boolean_flag_with_a_value_still_works(argv, expected):
    config, flags = parse_flags(argv)
    assert flags["decode_at_model_size"] is expected


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
