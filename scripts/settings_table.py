"""Print the README's settings table from app/settings.py, so the manual cannot drift from the code."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.settings import Settings, env_name, flag_name, setting_fields  # noqa: E402


def default_text(value) -> str:
    if value is None:
        return '`""` (all)'
    if isinstance(value, tuple):
        return f"`{','.join(str(v) for v in value)}`" if value else '`""`'
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'

    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"`{value // 2**20}MiB`"
    return f"`{value}`"


def settings_table() -> str:
    """Return the markdown table: setting, env, flag, default, meaning."""
    defaults = Settings()
    rows = ["| setting | environment | flag | default | meaning |", "|---|---|---|---|---|"]
    for f in setting_fields():
        rows.append(
            f"| `{f.name}` | `{env_name(f.name)}` | `{flag_name(f.name)}` | "
            f"{default_text(getattr(defaults, f.name))} | {f.metadata['help']} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(settings_table())
