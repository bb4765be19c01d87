"""Worker groups in the settings: the [groups.<name>] tables and the rule that a member may not disagree.

A model's `worker_group` names the worker process it shares with the other models that name it ('' is
its own worker, as before groups). What a worker applies to its whole process (the GPU memory policy
and cap, the GPUs it sees) is the group's: set once in [groups.<name>], else the server-wide value. A
member whose own [models.<name>] table sets one of those keys to another value is a contradiction the
server cannot serve: load_settings raises ConfigError, and the entry point exits with status 2, naming
the file, the models and the keys.

This module knows nothing of Settings itself (app.settings imports it, not the other way round): it is
handed the parser of each key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import ConfigError

# What a [groups.<name>] table may set: what its worker applies process-wide, and so what no member may differ in.
GROUP_KEYS = ("gpu_memory", "gpus")
GROUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")  # as a model's name


def group_name(value: Any) -> str:
    """Parse a worker group's name ('' is the model's own worker)."""
    name = str(value).strip()
    if name and not GROUP_NAME.match(name):
        raise ValueError("expected a group name: letters, digits, '.', '_' or '-', at most 63 ('': its own worker)")
    return name


def parse_tables(section: str, tables: Any, path: Path, keys: tuple[str, ...],
                 parse: Callable[[str, Any, str], Any], what: str) -> tuple:
    """Parse a TOML file's [<section>.<name>] tables into (name, ((key, value), ...)) pairs, each key one of `keys`.

    `parse(key, raw, source)` parses one value; `what` is what a table's name names (a model, a group).
    Used for [models.<name>] and [groups.<name>] alike.
    """
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise ConfigError(f"config file {path}: {section!r} must hold one [{section}.<name>] table per {what}")
    parsed = []
    for name, table in tables.items():
        if not GROUP_NAME.match(name):
            raise ConfigError(f"config file {path}: [{section}.{name}] does not name a {what}: "
                              "letters, digits, '.', '_' or '-', at most 63")
        entries = []
        for key, raw in table.items():
            if key not in keys:
                raise ConfigError(f"config file {path}: [{section}.{name}] has unknown key {key!r}; "
                                  f"a {what}'s table may set {', '.join(keys)}")
            entries.append((key, parse(key, raw, f"{key} in [{section}.{name}] of {path}")))
        parsed.append((name, tuple(entries)))
    return tuple(parsed)


def group_values(group: str, tables: tuple, server_wide: Mapping[str, Any]) -> dict[str, Any]:
    """Return a group's process-wide values: its table's, else the server-wide ones."""
    values = {key: server_wide[key] for key in GROUP_KEYS}
    values.update(dict(dict(tables).get(group, ())))
    return values


def check_group_conflicts(overrides: tuple, tables: tuple, server_wide: Mapping[str, Any],
                          path: Any) -> None:
    """Raise ConfigError if a member of a named group sets a process-wide key to another value than its group's.

    `overrides` are the [models.<name>] tables, parsed; `server_wide` the values every model starts from.
    """
    conflicts: dict[str, list[tuple[str, list[str]]]] = {}
    for model, entries in overrides:
        own = dict(entries)
        group = own.get("worker_group", server_wide.get("worker_group", ""))
        if not group:
            continue
        wanted = group_values(group, tables, server_wide)
        keys = [key for key in GROUP_KEYS if key in own and own[key] != wanted[key]]
        if keys:
            conflicts.setdefault(group, []).append((model, keys))
    for group, members in conflicts.items():
        models = ", ".join(model for model, _ in members)
        keys = sorted({key for _, found in members for key in found})
        raise ConfigError(
            f"config file {path}: model(s) {models} of worker group {group!r} set {', '.join(keys)} in their own "
            f"[models.<name>] table to another value than the group's; one worker applies them to its whole "
            f"process, so set them once in [groups.{group}] and remove them from the models' tables")
