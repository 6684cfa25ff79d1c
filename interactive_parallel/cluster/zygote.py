"""Zygote: import torch and transformers once, then fork the engines from that process.

On Linux a rank pool's memory and start time are mostly what each engine spends
importing torch and transformers. Forked from one process that imported
them, the engines share those pages copy-on-write and skip the import: on 2 cores the
pool is ready sooner and a 4-rank tour fits Binder's memory (bench/bench_session.py).

The parent stays small: a template child imports and forks N engines; the parent
(their subreaper) forwards SIGTERM/SIGINT to its process group and exits when every
child has exited. Given a request pipe (a FIFO), the template stays and forks more
engines on request ("N\n" written to the pipe): a dead rank's replacement then starts in
a fraction of a second instead of importing torch again (a fresh zygote would take
seconds: bench/bench_session.py); without one it exits once the N are forked. Each child runs
a plain ipyparallel engine (no nanny process: the controller's heartbeat already notices
a dead engine) connected through $IPP_CONNECTION_INFO, read from the controller's engine
connection file once the controller has written it (the imports run meanwhile). Knows
nothing of ranks or models; nothing may start a thread or a zmq context in the template,
and nothing may initialise CUDA there: a child forked after that fails at its first CUDA call.
So torch's CUDA checks go through NVML in the template (PYTORCH_NVML_BASED_CUDA_CHECK=1,
which does not touch the driver), and a template that finds CUDA initialised after its imports
exits with CUDA_TOUCHED before forking anything (the pool then launches engines without it).

The standing template costs memory: it keeps the original of every page an engine has since
written (copy-on-write leaves the template the only holder), measured at 100-115 MiB of its own
under the tour. Where the memory this process may use is under KEEP_TEMPLATE_BYTES (the machine's,
or a cgroup's limit: Binder gives 2 GB for the whole container) the pool asks for no standing template
(`keeps_template()`); a replacement rank then comes from a fresh zygote, seconds instead of a
fraction of one, and everything else is the same.

Run: python -m interactive_parallel.cluster.zygote N PROFILE_DIR ENGINE_CONNECTION_FILE [REQUEST_FIFO]
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

CONNECTION_TIMEOUT_S = 120.0
CUDA_TOUCHED = 3
"""The template's exit code when its imports initialised CUDA (no engine may be forked from it)."""
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
KEEP_TEMPLATE_BYTES = 4 * 10**9
"""Below this memory limit the template exits once it has forked (see the module docstring)."""


def keeps_template() -> bool:
    """Whether a standing template (fast replacement ranks) fits this process's memory limit."""
    from interactive_parallel.runtime.rank.cores import memory_limit

    limit = memory_limit()
    return limit is None or limit >= KEEP_TEMPLATE_BYTES


def _child(profile_dir: str, requests: int | None = None) -> None:
    if requests is not None:
        os.close(requests)
    if not keeps_template():
        # A small machine's ranks hand each large freed block back at once (runtime/rank/heap.py):
        # their peaks within a step add up across the ranks that share its memory.
        from interactive_parallel.runtime.rank.heap import return_large_frees

        return_large_frees()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
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


def cuda_touched() -> bool:
    """Whether this process has initialised CUDA (torch's lazy init ran)."""
    import torch

    return torch.cuda.is_initialized()


ENGINE_IMPORTS = ("ipykernel.debugger", "ipyparallel.datapub", "IPython.core.completerlib",
                  "IPython.extensions.storemagic", "sqlite3", "tornado.platform.asyncio",
                  "torch.distributed.pipelining", "torch.distributed.checkpoint.state_dict",
                  "torch.utils.serialization", "interactive_parallel.cluster.engine_side")
"""What every engine imports after the fork anyway (its kernel's debugger, the calls the client
sends): imported once here instead, with every module of interactive_parallel.runtime."""


def _import_engine_side() -> None:
    """Modules an engine would import after the fork, each then a private copy in every engine
    (measured: 9-10 MiB of each engine's private memory, bench/bench_notebook_memory.py). None of
    them starts a thread or a zmq context at import."""
    import importlib
    import pkgutil

    from interactive_parallel import runtime

    for name in ENGINE_IMPORTS:
        importlib.import_module(name)
    for info in pkgutil.walk_packages(runtime.__path__, runtime.__name__ + "."):
        importlib.import_module(info.name)


def _template(n: int, profile_dir: str, connection_file: str, fifo: str | None) -> None:
    import gc

    # Before torch is imported: transformers asks torch.cuda.is_available() as it loads, which
    # would otherwise initialise the driver (cuInit) and spoil every fork.
    os.environ.setdefault(NVML_CHECK, "1")

    import ipyparallel.engine.app  # noqa: F401

    from interactive_parallel.runtime.rank.warm import import_heavy

    import_heavy()  # here, unlike the warm-up thread, a failure stops the zygote with its error
    _import_engine_side()
    if cuda_touched():
        print("zygote: importing torch and transformers initialised CUDA in the template; engines forked "
              "from it would fail at their first CUDA call, so none is forked", file=sys.stderr, flush=True)
        os._exit(CUDA_TOUCHED)

    os.environ["IPP_CONNECTION_INFO"] = _connection_info(connection_file)
    # Read-write: the open never waits for a writer, and the pipe never reads as closed.
    requests = os.open(fifo, os.O_RDWR) if fifo else None

    # Keep the cyclic GC from writing to every imported object in the children, which
    # would copy the very pages the fork shares.
    gc.freeze()
    _spawn(n, profile_dir, requests)
    if requests is None:
        os._exit(0)
    signal.signal(signal.SIGCHLD, _reap)  # engines forked from here are our children
    pending = b""
    while True:
        chunk = os.read(requests, 64)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if line.strip().isdigit():
                _spawn(int(line), profile_dir, requests)


def _spawn(n: int, profile_dir: str, requests: int | None) -> None:
    for _ in range(n):
        if os.fork() == 0:
            _child(profile_dir, requests)


def _reap(_sig, _frame) -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def main(argv: list[str]) -> int:
    n, profile_dir, connection_file = int(argv[0]), argv[1], argv[2]
    fifo = argv[3] if len(argv) > 3 else None
    # This process stays small (no torch): a template child imports and forks the engines
    # (then exits, or stays for more); orphaned engines become our children (subreaper).
    _become_subreaper()
    template = os.fork()
    if template == 0:
        _template(n, profile_dir, connection_file, fifo)
    if fifo:
        with open(fifo + ".pid", "w") as f:
            f.write(str(template))

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
