"""Read an Object Detection API label map (`label_map.pbtxt`, protobuf text format).

    item { id: 1 name: 'person' display_name: 'Person' }

Either quote style, fields in any order, `#` comments, optional colons before messages, and
nested messages (keypoints, say) that are skipped. `display_name` wins, then `name`, else
`class_<id>`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

from ..errors import ModelError

_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<word>[A-Za-z_][A-Za-z0-9_.]*|[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)
  | (?P<punct>[{}:;,<>\[\]])
    """,
    re.VERBOSE,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}


def _unquote(literal: str) -> str:
    body = literal[1:-1]
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), body)


def _tokens(text: str, where: str) -> Iterator[tuple[str, str, int]]:
    pos, line = 0, 1
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match:
            raise ModelError(f"{where}: line {line}: unexpected character {text[pos]!r}")
        kind = match.lastgroup
        if kind != "space":
            yield kind, match.group(), line
        line += match.group().count("\n")
        pos = match.end()


class _Parser:
    def __init__(self, text: str, where: str):
        self._tokens = list(_tokens(text, where))
        self._pos = 0
        self._where = where

    def _peek(self):
        return self._tokens[self._pos] if self._pos < len(self._tokens) else (None, None, None)

    def _next(self):
        token = self._peek()
        if token[0] is None:
            last = self._tokens[-1][2] if self._tokens else 1
            raise ModelError(f"{self._where}: line {last}: unexpected end of file")
        self._pos += 1
        return token

    def _fail(self, line, what):
        return ModelError(f"{self._where}: line {line}: {what}")

    def message(self, closing) -> dict:
        """Parse fields up to `closing` (None: end of file); return scalars, and lists for messages."""
        fields: dict = {}
        while True:
            kind, text, line = self._peek()
            if kind is None:
                if closing is None:
                    return fields
                raise self._fail(self._tokens[-1][2], f"missing {closing!r}")
            if kind == "punct" and text == closing:
                self._pos += 1
                return fields
            if kind == "punct" and text in ";,":
                self._pos += 1
                continue
            kind, name, line = self._next()
            if kind != "word":
                raise self._fail(line, f"expected a field name, found {name!r}")
            kind, text, line = self._next()
            if text == ":":
                kind, text, line = self._next()
            if text in ("{", "<"):
                fields.setdefault(name, []).append(self.message("}" if text == "{" else ">"))
            elif kind in ("string", "word"):
                fields[name] = _unquote(text) if kind == "string" else text
            else:
                raise self._fail(line, f"expected a value for {name!r}, found {text!r}")


def parse_label_map(text: str, where: str = "label map") -> dict[int, str]:
    """Parse label-map text into {class id: display label}; raise ModelError naming the line."""
    top = _Parser(text, where).message(None)
    labels: dict[int, str] = {}
    for item in top.get("item", []):
        if "id" not in item:
            raise ModelError(f"{where}: an item has no id")
        try:
            class_id = int(item["id"])
        except ValueError:
            raise ModelError(f"{where}: item id {item['id']!r} is not an integer") from None
        labels[class_id] = item.get("display_name") or item.get("name") or f"class_{class_id}"
    return labels


def load_label_map(path: Path) -> dict[int, str]:
    """Read label_map.pbtxt; an absent file gives no labels (every class is class_<id>)."""
    if not path.exists():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} cannot be read: {exc}") from None
    return parse_label_map(text, str(path))


def label_for(labels: dict[int, str], class_id: int) -> str:
    """Return a class's label, or class_<id> where the map has none."""
    return labels.get(class_id, f"class_{class_id}")
