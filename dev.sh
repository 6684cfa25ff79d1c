#!/usr/bin/env bash
# The two commands of the README:
#   ./dev.sh start [--demo]   set up, then open the tour in JupyterLab (or run the headless demo)
#   ./dev.sh test  [pytest args]   set up, then run the test suite
# Setup is idempotent: a virtual environment in .venv, the CPU build of torch (IP_TORCH=cuda for
# the default index's CUDA build on a GPU machine), this package.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${IP_VENV:-.venv}
PY="$VENV/bin/python"

TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu

install_torch() {
  # torch first, pinned: asked for without a pin (or by another package), pip takes the default
  # index's build, which on Linux is the multi-GB CUDA one. IP_TORCH=cuda asks for that on purpose
  # (a GPU machine); otherwise PyTorch's CPU wheel index when it answers, else what pip finds.
  local pip=("$PY" -m pip install -q --disable-pip-version-check)
  if [ "${IP_TORCH:-cpu}" = cuda ]; then
    # pip takes an installed 2.13.0+cpu as satisfying torch==2.13.0 (it ignores the local label),
    # so a CPU build already in the venv goes first; then the build must know CUDA, or we stop.
    if "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null; then
      "$PY" -m pip uninstall -q -y torch
    fi
    "${pip[@]}" "torch==$TORCH_VERSION"
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
      echo "IP_TORCH=cuda: the torch pip installed has no CUDA ($("$PY" -c 'import torch; print(torch.__version__)'))" >&2
      exit 1
    fi
    echo "torch: the default index's CUDA build $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
  elif timeout 10 "$PY" -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=8)" 2>/dev/null; then
    "${pip[@]}" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple "torch==$TORCH_VERSION+cpu"
    echo "torch: the CPU build from $CPU_INDEX"
  else
    "${pip[@]}" "torch==$TORCH_VERSION"
    echo "torch: $CPU_INDEX did not answer; installed what pip found: $("$PY" -c 'import torch; print(torch.__version__)')"
  fi
}

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
  fi
  local stamp="$VENV/.ip-setup" want
  want="$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)-$1-${IP_TORCH:-cpu}"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  install_torch
  # constraints.txt: the versions the suite passed on (a new upstream release is taken on purpose)
  if [ "$1" = test ]; then
    "$PY" -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
  else
    "$PY" -m pip install -q --disable-pip-version-check -c constraints.txt -e .
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

launchers() {
  # The site software the launcher tests run for real (Slurm with munge, sshd, Open MPI), from
  # Debian's packages, and mpi4py for ipyparallel's MPI engines; without root they skip, saying so.
  if [ -n "${IP_SKIP_LAUNCHERS:-}" ]; then return; fi
  if ! command -v slurmctld >/dev/null || ! command -v mpiexec >/dev/null || [ ! -x /usr/sbin/sshd ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge openmpi-bin \
        libopenmpi-dev openssh-server openssh-client >/dev/null) || echo "note: Slurm / MPI / sshd not installed; launcher tests will be skipped"
    fi
  fi
  if command -v mpiexec >/dev/null && ! "$PY" -c "import mpi4py" 2>/dev/null; then
    "$PY" -m pip install -q --disable-pip-version-check "mpi4py>=4.0" || echo "note: mpi4py not installed; the MPI launcher test will be skipped"
  fi
}

cmd=${1:-start}; shift || true
case "$cmd" in
  start)
    setup run
    if [ "${1:-}" = "--demo" ]; then
      shift
      exec "$VENV/bin/interactive-parallel" demo --steps 800 --report report.html "$@"
    fi
    extra=()
    [ "$(id -u)" = 0 ] && extra+=(--allow-root)  # containers and Binder-like machines run as root
    exec "$VENV/bin/jupyter" lab ${extra[@]+"${extra[@]}"} notebooks/00_tour.ipynb "$@"
    ;;
  test)
    setup test
    browser
    launchers
    exec "$PY" -m pytest "$@"
    ;;
  *) echo "usage: ./dev.sh start [--demo] | ./dev.sh test [pytest args]" >&2; exit 2 ;;
esac
