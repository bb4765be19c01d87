"""Generate the settings reference from app/settings.py, and check config/default.toml against it.

The one source of every setting is the Settings dataclass: its help text and default make the `serve --help`
lines (app.hosting.serve.setting_help), this table (docs/reference/settings.md, rendered at build time by
tools/docs/hooks.py) and the list config/default.toml must name. Run it to print the table; with
`--check-config FILE`, to list the settings the file leaves out (exit 1 if any).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from app.settings import (PER_MODEL_KEYS, default_text, env_name, flag_name, grouped_setting_fields,
                          setting_fields)

# A key line of the TOML file, set or commented out ("# model = ..." documents a setting left unset).
_KEY_LINE = re.compile(r"^\s*#?\s*([a-z_]+)\s*=", re.MULTILINE)


def _cell(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def settings_table() -> str:
    """Return one markdown table per section of `serve --help`: setting, env, flag, default, meaning."""
    sections = []
    for title, fields in grouped_setting_fields():
        rows = [f"### {title}", "", "| setting | environment | flag | default | meaning |", "|---|---|---|---|---|"]
        for f in fields:
            default = f"`{default_text(f.name)}`" + (" (all)" if f.name == "gpus" else "")
            per_model = " Also in a `[models.<name>]` table." if f.name in PER_MODEL_KEYS else ""
            rows.append(
                f"| `{f.name}` | `{env_name(f.name)}` | `{flag_name(f.name)}` | "
                f"{default} | {_cell(f.metadata['help'])}.{per_model} |"
            )
        sections.append("\n".join(rows))
    return "\n\n".join(sections)


def missing_from_config(text: str) -> list[str]:
    """Return the settings a TOML settings file's text neither sets nor names in a commented-out line."""
    named = set(_KEY_LINE.findall(text.split("\n[", 1)[0]))  # the top level, before the first table
    return [f.name for f in setting_fields() if f.name not in named]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check-config"] and len(argv) == 2:
        missing = missing_from_config(Path(argv[1]).read_text())
        for name in missing:
            print(f"{argv[1]} does not name the setting {name} (add `{name} = {default_text(name)}`, "
                  "or a commented-out line)", file=sys.stderr)
        return 1 if missing else 0
    if argv:
        print("usage: python -m tools.docs.settings_table [--check-config FILE]", file=sys.stderr)
        return 2
    print(settings_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
