# Sourced by scripts/run and scripts/test: make .venv and install the project with the given extras.
# Skips pip when pyproject.toml has not changed since the last install into this venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
ensure_venv() {
  local extras="$1"
  local python="${PYTHON:-python3}"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV" >&2
    "$python" -m venv "$VENV"
  fi
  local stamp="$VENV/.installed-$(echo "$extras" | tr -c 'a-z0-9' '_')"
  local want
  want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "installing the project into $VENV${extras:+ with [$extras]}" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT${extras:+[$extras]}"
    echo "$want" > "$stamp"
  fi
}
