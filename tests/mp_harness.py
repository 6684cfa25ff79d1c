"""Spawn a group of gloo ranks on this host, run one function on each, return what each returned.

Owns process start (torch.multiprocessing, spawn), the free loopback port, one intra-op
thread per rank, a wall-clock timeout, and turning a rank's exception into a
RuntimeError that names the rank and carries its traceback. Each rank joins the group
through runtime.launch, the start-up of a torchrun process, given what torchrun would set. Knows nothing of
what the ranks compute: `fn(rank, *args)` must be a module-level (picklable) function.
"""
from __future__ import annotations

import io
import os
import queue
import time
import traceback

import torch
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out."""


def _entry(fn, rank: int, world: int, port: int, timeout_s: float, args, out) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        from interactive_parallel.runtime import dist as rdist
        from interactive_parallel.runtime.launch import init_from_env

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


def run_ranks(fn, world: int, *args, timeout_s: float = 240.0, collective_timeout_s: float = 60.0) -> list:
    """[fn(0, *args), ..., fn(world - 1, *args)], each run in its own process with gloo."""
    from interactive_parallel.runtime.dist import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, collective_timeout_s, args, out), daemon=True)
                 for r in range(world)]
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
                    raise RankFailure(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append(f"rank {rank} raised:\n{value}")
                # The others may be blocked in a collective with the failed rank: stop waiting.
                break
        if failures:
            raise RankFailure("\n".join(failures))
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
