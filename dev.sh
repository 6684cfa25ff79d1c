#!/usr/bin/env bash
# The two commands of the README:
#   ./dev.sh start [--demo]   set up, then open the tour in JupyterLab (or run the headless demo)
#   ./dev.sh test  [pytest args]   set up, then run the test suite
# Setup is idempotent: a virtual environment in .venv, the CPU build of torch, this package.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${IP_VENV:-.venv}
PY="$VENV/bin/python"

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
  fi
  local stamp="$VENV/.ip-setup" want
  want="$(cat pyproject.toml | sha1sum | cut -c1-12)-$1"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  # Pinned CPU build first: an unpinned torch would pull a multi-GB CUDA build.
  "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  if [ "$1" = test ]; then
    "$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
  else
    "$PY" -m pip install -q --disable-pip-version-check -e .
  fi
  echo "$want" > "$stamp"
}

browser() {
  # Debian's Chromium for the Playwright browser tests (Playwright's own download cannot run here).
  if [ -x /usr/lib/chromium/chromium ] || [ -n "${IP_SKIP_BROWSER:-}" ]; then return; fi
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "note: chromium not installed; browser tests will be skipped"
  fi
}

cmd=${1:-start}; shift || true
case "$cmd" in
  start)
    setup run
    if [ "${1:-}" = "--demo" ]; then
      shift
      exec "$VENV/bin/interactive-parallel" demo --ranks 4 --plan dp=4 --steps 30 --report report.html "$@"
    fi
    extra=()
    [ "$(id -u)" = 0 ] && extra+=(--allow-root)  # containers and Binder-like machines run as root
    exec "$VENV/bin/jupyter" lab ${extra[@]+"${extra[@]}"} notebooks/00_tour.ipynb "$@"
    ;;
  test)
    setup test
    browser
    exec "$PY" -m pytest "$@"
    ;;
  *) echo "usage: ./dev.sh start [--demo] | ./dev.sh test [pytest args]" >&2; exit 2 ;;
esac
