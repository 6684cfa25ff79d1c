"""The leash: a tiny watcher process that stops a rank pool when its client process dies.

A bare ipyparallel pool outlives the kernel that started it (engines and controller run
in sessions of their own). The Session starts this watcher next to the pool; it polls
the client's pid and, once the client is gone (killed, kernel restarted), signals the
process groups listed in the state file and deletes the pool's files (after outwaiting
the processes it lists as still writing there). A normal stop
deletes the state file and the watcher exits. Knows nothing of ipyparallel or torch:
only pids, process groups and paths, so it starts in a fraction of a second.

Run: python -m interactive_parallel.cluster.reaper CLIENT_PID CLIENT_START_TIME STATE_FILE
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

POLL_S = 0.25
GRACE_S = 0.5
"""SIGTERM, then SIGKILL after this long. Short: an engine busy in a step (or blocked in a
collective) runs ipyparallel's SIGTERM handler only when the step ends, and a kernel's death
takes its pool with it soon (tests/test_faults_kernel.py holds it to a limit)."""
WAIT_S = 10.0
"""How long to outwait the processes a state file says may still write into its paths."""


def _alive(pid: int, start_time: float | None) -> bool:
    try:
        import psutil

        p = psutil.Process(pid)
        # A recycled pid is a different process: compare start times.
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE and (
            start_time is None or abs(p.create_time() - start_time) < 1.0)
    except Exception:  # noqa: BLE001 - any failure to see the process means it is gone
        return False


def _signal_groups(groups: list[list[float]], sig: int) -> list[list[float]]:
    left = []
    for pgid, start in groups:
        if not _alive(int(pgid), start):
            continue
        try:
            os.killpg(int(pgid), sig)
            left.append([pgid, start])
        except (ProcessLookupError, PermissionError):
            pass
    return left


def reap(state: dict) -> None:
    groups = state.get("groups", [])
    groups = _signal_groups(groups, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while groups and time.monotonic() < deadline:
        time.sleep(0.1)
        groups = [g for g in groups if _alive(int(g[0]), g[1])]
    _signal_groups(groups, signal.SIGKILL)
    # Processes in sessions of their own (engine nannies) are outside those groups.
    for pid, start in state.get("procs", []):
        if _alive(int(pid), start):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    # Processes that may still write into the paths (another leash is ending them): outwait them.
    waited = [w for w in state.get("wait", []) if _alive(int(w[0]), w[1])]
    deadline = time.monotonic() + WAIT_S
    while waited and time.monotonic() < deadline:
        time.sleep(0.05)
        waited = [w for w in waited if _alive(int(w[0]), w[1])]
    for path in state.get("paths", []):
        shutil.rmtree(path, ignore_errors=True)


def stamped(pids: list[int]) -> list[list[float]]:
    """[pid, start time] of each process still running (a recycled pid is told apart by it)."""
    import psutil

    rows = []
    for pid in pids:
        try:
            rows.append([pid, psutil.Process(pid).create_time()])
        except psutil.NoSuchProcess:
            pass
    return rows


def write_state(state_file: str, state: dict) -> None:
    """Replace the state file in one step (the watcher may read it at any moment)."""
    tmp = state_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, state_file)


def start(state_file: str):
    """Leash this process: a watcher that reaps what `state_file` lists once this process is gone
    (and exits by itself once `state_file` is deleted). Returns its subprocess.Popen."""
    import subprocess

    import psutil

    me = psutil.Process()
    return subprocess.Popen(
        [sys.executable, "-m", "interactive_parallel.cluster.reaper", str(me.pid), repr(me.create_time()), state_file],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True)


def main(argv: list[str]) -> int:
    client_pid, client_start, state_file = int(argv[0]), float(argv[1]), argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the notebook's terminal is not ours
    while True:
        if not os.path.exists(state_file):
            return 0  # the session stopped its pool itself
        if not _alive(client_pid, client_start):
            try:
                with open(state_file) as f:
                    state = json.load(f)
            except (OSError, ValueError):
                return 0
            reap(state)
            try:
                os.remove(state_file)
            except OSError:
                pass
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
