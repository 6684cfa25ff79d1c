"""Zygote: import torch and transformers once, then fork the engines from that process.

On Linux a rank pool's memory and start time are mostly the ~250 MB and ~2 s each
engine spends importing torch and transformers. Forked from one process that imported
them, the engines share those pages copy-on-write and skip the import: on 2 cores the
pool is ready sooner and a 4-rank tour fits Binder's memory (bench/bench_session.py).

The parent stays small: a template child imports, forks N engines and exits; the
parent (their subreaper) forwards SIGTERM/SIGINT to them and exits when they have all
exited. Each child runs a plain ipyparallel engine (no nanny process: the
controller's heartbeat already notices a dead engine) connected through
$IPP_CONNECTION_INFO, read from the controller's engine connection file once the
controller has written it (the imports run meanwhile). Knows nothing of ranks or
models; nothing may start a thread or a zmq context before the fork.

Run: python -m interactive_parallel.cluster.zygote N PROFILE_DIR ENGINE_CONNECTION_FILE
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

CONNECTION_TIMEOUT_S = 120.0


def _child(profile_dir: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.argv = ["ipengine", f"--profile-dir={profile_dir}", "--IPEngine.enable_nanny=False"]
    from ipyparallel.engine.app import main

    try:
        main()
    finally:
        os._exit(0)


def _become_subreaper() -> None:
    """Orphaned descendants are re-parented to us instead of to init, so we can wait for them."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _connection_info(path: str) -> str:
    deadline = time.monotonic() + CONNECTION_TIMEOUT_S
    while True:
        try:
            with open(path) as f:
                text = f.read()
            json.loads(text)  # a half-written file fails here: read again
            return text
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                print(f"zygote: no controller connection file {path}", file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(0.05)


def _template(n: int, profile_dir: str, connection_file: str) -> None:
    import gc

    import ipyparallel.engine.app  # noqa: F401

    from interactive_parallel.runtime.warm import import_heavy

    import_heavy()  # here, unlike the warm-up thread, a failure stops the zygote with its error

    os.environ["IPP_CONNECTION_INFO"] = _connection_info(connection_file)

    # Keep the cyclic GC from writing to every imported object in the children, which
    # would copy the very pages the fork shares.
    gc.freeze()
    for _ in range(n):
        if os.fork() == 0:
            _child(profile_dir)
    os._exit(0)


def main(argv: list[str]) -> int:
    n, profile_dir, connection_file = int(argv[0]), argv[1], argv[2]
    # This process stays small (no torch): a template child imports and forks the engines,
    # then exits; the engines become our children (subreaper) and we wait for them.
    _become_subreaper()
    if os.fork() == 0:
        _template(n, profile_dir, connection_file)

    def forward(sig, _frame):
        signal.signal(sig, signal.SIG_IGN)
        os.killpg(0, sig)  # the engines share our process group

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    worst = 0
    while True:
        try:
            _, status = os.waitpid(-1, 0)
            worst = max(worst, os.waitstatus_to_exitcode(status))
        except InterruptedError:
            continue
        except ChildProcessError:
            return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
