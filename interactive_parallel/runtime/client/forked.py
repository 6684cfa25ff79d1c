"""A dry run's simulated ranks shared out between this process and forked copies of it, one per
usable core: a dry run is pure Python on fake tensors, so one process keeps one core busy and a
second core halves a many-stage plan's wait.

Owns the split, the children and what comes back. Each child is a fork of this process (torch,
transformers and the model's spec already imported: nothing loads again), takes its share of the
items with one intra-op thread (a fork may not use the OpenMP threads its parent started: torch's
DataLoader workers do the same), and sends its results back pickled through a pipe, with the
warnings it raised (shown here, as if raised here). It leaves with os._exit, so nothing this
process owns (sockets, atexit handlers, a Jupyter kernel's output streams) runs twice. A child
that raises makes the call raise its exception, its traceback added as a note; one that dies or
stalls is named with its items and killed. Where a fork is not worth it or not safe (one usable
core, one item, no os.fork, CUDA started in this process, IP_DRY_RUN_PROCESSES=1), every item runs here, in order.

Written here rather than taken from multiprocessing: its fork context starts a resource tracker
and a feeder thread per queue, and its worker pools outlive the call; this forks once per call,
reads one pipe per child and reaps every child before returning.

Knows nothing of what an item is or what the function does.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from ..rank.cores import usable_cores

ENV = "IP_DRY_RUN_PROCESSES"
"""How many processes a dry run may use (default: the usable cores; 1: none forked)."""
STALL_FACTOR = 10
"""A child still running this many times as long as this process took for its own share (and at
least MIN_WAIT_S) is stuck: its items take as long as this process's."""
MIN_WAIT_S = 600.0


class ForkedError(RuntimeError):
    """A forked child died or stalled before sending its results."""


@dataclass
class _Child:
    pid: int
    fd: int
    items: list


def processes() -> int:
    """How many processes a call may use here."""
    asked = os.environ.get(ENV, "").strip()
    if asked:
        return max(1, int(asked))
    torch = sys.modules.get("torch")
    if not hasattr(os, "fork") or (torch is not None and torch.cuda.is_initialized()):
        return 1  # a fork cannot use the CUDA this process started
    return usable_cores()


def map_forked(fn: Callable[[Any], Any], items: list, what: str = "item") -> dict:
    """{item: fn(item)} for every item, computed across up to `processes()` processes.
    `what` names an item in errors ('simulated rank')."""
    items = list(items)
    n = min(processes(), len(items))
    if n <= 1:
        return {i: fn(i) for i in items}
    shares = [items[k::n] for k in range(n)]
    children: list[_Child] = []
    try:
        for share in shares[1:]:
            children.append(_fork(fn, share))
        start = time.monotonic()
        out = {i: fn(i) for i in shares[0]}
        wait = max(MIN_WAIT_S, STALL_FACTOR * (time.monotonic() - start))
        for child in children:
            out.update(_collect(child, time.monotonic() + wait, what))
    finally:
        for child in children:
            _reap(child)
    return {i: out[i] for i in items}


def _fork(fn: Callable[[Any], Any], share: list) -> _Child:
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return _Child(pid, read, share)
    # the child: never returns into the caller's code
    code = 1
    try:
        os.close(read)
        code = _serve(fn, share, write)
    finally:
        os._exit(code)


def _serve(fn: Callable[[Any], Any], share: list, fd: int) -> int:
    import torch

    torch.set_num_threads(1)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # not a kernel's streams: their threads stay behind
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            payload: tuple = ("ok", {i: fn(i) for i in share})
        except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
            payload = ("raised", _picklable(e), traceback.format_exc())
    seen = list(dict.fromkeys((str(w.message), w.category, w.filename, w.lineno) for w in caught))
    with os.fdopen(fd, "wb") as pipe:
        pickle.dump((*payload, seen), pipe, protocol=pickle.HIGHEST_PROTOCOL)
    return 0


def _picklable(e: BaseException) -> BaseException:
    try:
        return pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - an exception that does not pickle is sent as its words
        return RuntimeError(f"{type(e).__name__}: {e}")


def _collect(child: _Child, deadline: float, what: str) -> dict:
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ForkedError(f"the forked process simulating {what}s {child.items} (pid {child.pid}) sent nothing "
                              f"for {STALL_FACTOR}x as long as this process's share took: killed")
        ready, _, _ = select.select([child.fd], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(child.fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    try:
        status, value, *rest = pickle.loads(b"".join(chunks))
    except Exception:  # noqa: BLE001 - nothing or a torn message: the child died on the way
        raise ForkedError(f"the forked process simulating {what}s {child.items} (pid {child.pid}) died "
                          f"({_how_it_ended(child)}) before sending its results") from None
    caught = rest[-1]
    for message, category, filename, lineno in caught:
        warnings.warn_explicit(message, category, filename, lineno)
    if status == "raised":
        value.add_note(f"raised in the forked process simulating {what}s {child.items}:\n{rest[0]}")
        raise value
    return value


def _how_it_ended(child: _Child) -> str:
    try:
        pid, status = os.waitpid(child.pid, 0)
    except ChildProcessError:
        return "already reaped"
    child.pid = 0
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"


def _reap(child: _Child) -> None:
    """Close the pipe and make sure the child is gone (killed if it is still running)."""
    try:
        os.close(child.fd)
    except OSError:
        pass
    if not child.pid:
        return
    try:
        pid, _ = os.waitpid(child.pid, os.WNOHANG)
        if pid == 0:
            os.kill(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
    except (ChildProcessError, ProcessLookupError):
        pass
