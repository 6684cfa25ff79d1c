"""Spawn a group of gloo ranks on this host, run one function on each, return what each returned.

Owns process start (torch.multiprocessing, forkserver), the free loopback port, one intra-op
thread per rank, a wall-clock timeout, and turning a rank's exception into a
RuntimeError that names the rank and carries its traceback. A rank that dies of a native
crash (SIGSEGV, SIGBUS: a fault in torch's or gloo's C++, which no Python code of ours or of
the test can raise) is named first, before the peers' connection errors it causes, with the
Python stack faulthandler prints on its stderr; the group is then run once more, with a
warning that says so (a crash twice fails). A rank's exception is never retried. Each rank
joins the group through runtime.groups.launch, the start-up of a torchrun process, given what
torchrun would set. Knows nothing of what the ranks compute: `fn(rank, *args)` must be a
module-level (picklable) function.

Ranks start from multiprocessing's forkserver, which imports torch, transformers and the
runtime once (PRELOAD) and forks each rank from that: a group no longer pays each rank's own
imports (seconds per rank on 2 cores, over about fifty groups a run). The server is started
by the first group and forks with the environment it was started with, so each rank is handed
the caller's environment of the moment (a test's monkeypatched variable reaches its ranks as
under spawn). The server takes no other state: nothing is computed and no process group made
before a fork (torch's import leaves one idle native thread, as in the engines' zygote,
cluster/zygote.py, which forks the same way).
"""
from __future__ import annotations

import io
import os
import queue
import signal
import time
import traceback
import warnings

import torch
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out."""


class RankCrashed(RankFailure):
    """A rank died of a native crash (CRASHES)."""


CRASHES = {-signal.SIGSEGV: "SIGSEGV", -signal.SIGBUS: "SIGBUS"}
"""Exit codes of a rank process killed by a fault in native code."""


PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
           "interactive_parallel.runtime.groups.launch", "interactive_parallel.runtime.api"]
"""What the forkserver imports once for every rank it forks (a module it cannot import is
skipped by multiprocessing, and the rank imports it itself)."""


def _context():
    """multiprocessing's forkserver context with PRELOAD; the server starts with one thread
    per rank's libraries (OMP_NUM_THREADS=1 in its environment), as the ranks run."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(fn, rank: int, world: int, port: int, timeout_s: float, args, out, env: dict) -> None:
    try:
        import faulthandler

        import torch

        os.environ.clear()  # the caller's environment now, not the server's at its start
        os.environ.update(env)

        faulthandler.enable()  # a native crash prints the rank's Python stack on stderr
        torch.set_num_threads(1)
        from interactive_parallel.runtime.groups import dist as rdist
        from interactive_parallel.runtime.groups.launch import init_from_env

        # The start-up of the exported script and bench/, with what torchrun would have set.
        init_from_env("cpu", timeout_s, threads=1, rank=rank, world_size=world, local_rank=rank,
                      local_world_size=world, master_addr="127.0.0.1", master_port=port)
        try:
            result = fn(rank, *args)
        finally:
            rdist.teardown()
        # Bytes, not tensors: torch's queue pickler would pass tensors as shared-memory file
        # descriptors, which die with the rank process before the parent reads them.
        buf = io.BytesIO()
        torch.save(result, buf)
        out.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - shipped to the parent, which raises it
        out.put((rank, False, traceback.format_exc()))


RERUNS: list[str] = []
"""One line per group this process ran again after a native crash (the suite's summary counts them)."""


def run_ranks(fn, world: int, *args, timeout_s: float = 240.0, collective_timeout_s: float = 60.0) -> list:
    """[fn(0, *args), ..., fn(world - 1, *args)], each run in its own process with gloo."""
    try:
        return _run_once(fn, world, args, timeout_s, collective_timeout_s)
    except RankCrashed as exc:
        line = f"{exc.args[0].splitlines()[0]}: the group of {fn.__name__} runs once more"
        RERUNS.append(line)
        warnings.warn(line, RuntimeWarning)
        return _run_once(fn, world, args, timeout_s, collective_timeout_s)


def _run_once(fn, world: int, args: tuple, timeout_s: float, collective_timeout_s: float) -> list:
    from interactive_parallel.runtime.groups.dist import free_port

    ctx = _context()
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        env = dict(os.environ)
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, collective_timeout_s, args, out, env),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    return _collect(procs, out, world, timeout_s)


def _collect(procs, out, world: int, timeout_s: float) -> list:
    results: dict[int, object] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world)) - set(results))
                raise RankFailure(f"ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead and out.empty():
                    _raise_crashed(procs, [])
                    raise RankFailure(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append((rank, value))
                # The others may be blocked in a collective with the failed rank: stop waiting
                # for results, but take the errors its exit causes, which may arrive first.
                failures += _peer_errors(procs, out, {rank} | set(results), world)
                break
        if failures:
            text = "\n".join(f"rank {r} raised:\n{tb}" for r, tb in sorted(failures, key=_consequence))
            _raise_crashed(procs, [text])
            raise RankFailure(text)
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2)


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Broken pipe")
"""What gloo says on a rank whose peer is gone: the consequence of another rank's failure."""
GRACE_S = 5.0
"""How long the other ranks' errors are waited for after the first (they follow it within a
moment: a rank's exit ends its connections)."""


def _peer_errors(procs, out, reported: set[int], world: int) -> list[tuple[int, str]]:
    """The errors of the ranks not yet `reported`, as they come, until each has reported or
    ended or GRACE_S passed."""
    errors: list[tuple[int, str]] = []
    deadline = time.monotonic() + GRACE_S
    while len(reported) < world and time.monotonic() < deadline:
        try:
            rank, ok, value = out.get(timeout=0.1)
        except queue.Empty:
            if all(p.exitcode is not None for i, p in enumerate(procs) if i not in reported) and out.empty():
                break
            continue
        reported.add(rank)
        if not ok:
            errors.append((rank, value))
    return errors


def _consequence(failure: tuple[int, str]) -> tuple[bool, int]:
    """Sort key: a rank's own error before the peer-lost errors it caused, then by rank."""
    rank, tb = failure
    return any(m in tb for m in PEER_LOST), rank


def _raise_crashed(procs, failures: list[str]) -> None:
    """RankCrashed naming the ranks that died of a native crash, when any did (a peer's error,
    often gloo's 'Connection reset by peer', is its consequence and follows it)."""
    deadline = time.monotonic() + 2.0  # a crashed rank's exit code may come a moment after its peer's error
    while time.monotonic() < deadline and not any(p.exitcode in CRASHES for p in procs):
        time.sleep(0.05)
    crashed = [f"rank {i} died of {CRASHES[p.exitcode]}" for i, p in enumerate(procs) if p.exitcode in CRASHES]
    if crashed:
        raise RankCrashed("; ".join(crashed) + ("\n" + "\n".join(failures) if failures else "")) from None
