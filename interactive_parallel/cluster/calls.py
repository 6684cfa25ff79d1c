"""Remote calls to ranks: submit to each engine, wait with a timeout, fail fast, stream results.

Owns the engine-id -> rank mapping at call time, the timeouts, turning remote exceptions into
RankError / RankTimeout, and the two ways a call's results come back: at its end (`wait`), or
while it runs (`stream`): each rank publishes records with ipyparallel's data publication
(`publish_data`, keyed by a sequence number) and they are read here from each task's `data`
as they arrive. A long call is stopped with ipyparallel's `abort` of the running task, which
the rank sees at its next boundary (see cluster/engine_side.py). Knows nothing of models or
plans, and nothing of what the records mean.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Sequence

from .errors import RankError, RankTimeout, remote_error_fields

Submitted = list[tuple[int, Any]]
"""(rank, ipyparallel AsyncResult) of one call, in rank order."""

POLL_S = 0.02
"""How often a streaming call looks for new records: far below a step, far above its cost."""
PEER_GRACE_S = 0.2
"""After one rank failed, how long to wait for its peers' errors (they help) before raising."""


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: no "exception never retrieved" when nobody awaits it


class RankCaller:
    """Calls a function on ranks (engines in rank order) and collects per-rank results."""

    def __init__(self, client, engine_ids: Sequence[int], hosts: Sequence[str] | None = None):
        self.client = client
        self.engine_ids = list(engine_ids)
        self.hosts = list(hosts or [""] * len(self.engine_ids))
        self._views = {eid: client[eid] for eid in self.engine_ids}
        self._all = client[self.engine_ids]
        self.pending: Submitted = []
        """A call that failed fast or timed out while some ranks were still running it."""

    def submit(self, fn: Callable, args: Sequence[Any] = (), kwargs: dict | None = None, *,
               ranks: Sequence[int] | None = None,
               per_rank: Callable[[int], tuple[tuple, dict]] | None = None) -> Submitted:
        if ranks is None and per_rank is None and len(self.engine_ids) > 1:
            # One message for all ranks (the function and its arguments serialized once), split
            # into one future per rank so a failing rank is seen while the others still run.
            parts = self._all.apply_async(fn, *args, **(kwargs or {})).split()
            return list(enumerate(parts))
        out = []
        for rank in (range(len(self.engine_ids)) if ranks is None else ranks):
            a, k = per_rank(rank) if per_rank else (tuple(args), dict(kwargs or {}))
            out.append((rank, self._views[self.engine_ids[rank]].apply_async(fn, *a, **k)))
        return out

    # ---- waiting ------------------------------------------------------------------------------
    async def wait(self, submitted: Submitted, timeout: float, what: str = "call") -> list[Any]:
        """Every rank's result in rank order; the first failure raises at once (RankError)."""
        futs = self._wrap(submitted)
        await asyncio.wait(futs, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        return await self._settle(submitted, timeout, what)

    async def stream(self, submitted: Submitted, on_item: Callable[[int, Any], None], timeout: float,
                     what: str = "call") -> list[Any]:
        """Like `wait`, but each record a rank publishes is handed to `on_item(rank, record)` as it
        arrives, in the order the rank published it. `timeout` bounds the time without any progress
        (a record or a finished rank), not the whole call: a long run is fine, a stuck one is not."""
        futs = self._wrap(submitted)
        seen: dict[int, set] = {r: set() for r, _ in submitted}
        last = time.monotonic()
        finished = 0
        while True:
            done, _ = await asyncio.wait(futs, timeout=POLL_S, return_when=asyncio.FIRST_EXCEPTION)
            progress = self._drain(submitted, seen, on_item, final=False)
            if len(done) > finished or progress:
                finished, last = len(done), time.monotonic()
            failed = any(f.done() and f.exception() is not None for f in futs)
            if failed or len(done) == len(futs) or time.monotonic() - last > timeout:
                break
        await self._outputs_complete([ar for _, ar in submitted if ar.done()])
        self._drain(submitted, seen, on_item, final=True)
        return await self._settle(submitted, timeout, what)

    def abort(self, submitted: Submitted) -> None:
        """Ask the ranks still running `submitted` to stop at their next boundary (never blocks)."""
        running = [(r, ar) for r, ar in submitted if not ar.done()]
        if running:
            self.client.abort(jobs=[ar for _, ar in running], targets=[self.engine_ids[r] for r, _ in running],
                              block=False)

    async def drain(self, timeout: float) -> list[int]:
        """Wait for a previous call's stragglers; return the ranks that are still stuck."""
        if not self.pending:
            return []
        await asyncio.wait(self._wrap(self.pending), timeout=timeout)
        stuck = [r for r, ar in self.pending if not ar.done()]
        self.pending = [(r, ar) for r, ar in self.pending if not ar.done()]
        return stuck

    # ---- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _wrap(submitted: Submitted) -> list[asyncio.Future]:
        futs = [asyncio.wrap_future(ar) for _, ar in submitted]
        for f in futs:
            f.add_done_callback(_consume)
        return futs

    def _drain(self, submitted: Submitted, seen: dict[int, set], on_item, final: bool) -> bool:
        got = False
        for rank, ar in submitted:
            data = ar.data  # ipyparallel merges each published dict into the task's data
            fresh = sorted(k for k in list(data) if k not in seen[rank])
            for key in fresh:
                seen[rank].add(key)
                on_item(rank, data[key])
                got = True
        return got

    @staticmethod
    async def _outputs_complete(ars: list, limit: float = 5.0) -> None:
        """Published data travels on another channel than the reply and may trail it: wait
        (bounded) until ipyparallel says each finished task's output is complete."""
        deadline = time.monotonic() + limit
        while not all(ar.wait_for_output(0) for ar in ars) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def _raise_for(self, failed: Submitted, what: str) -> None:
        first_rank, first = failed[0]
        ename, evalue, tb = remote_error_fields(first.exception())
        others = {}
        for rank, ar in failed[1:]:
            e, v, _ = remote_error_fields(ar.exception())
            others[rank] = f"{e}: {v}"
        raise RankError(first_rank, ename, evalue, tb, host=self.hosts[first_rank], what=what, others=others,
                        stuck=[r for r, _ in self.pending])

    async def _settle(self, submitted: Submitted, timeout: float, what: str) -> list[Any]:
        failed = [(r, ar) for r, ar in submitted if ar.done() and ar.exception() is not None]
        running = [(r, ar) for r, ar in submitted if not ar.done()]
        if failed:
            if running:  # give peers a moment to fail too (their errors help), then leave them running
                await asyncio.wait(self._wrap(running), timeout=PEER_GRACE_S)
            failed += [(r, ar) for r, ar in running if ar.done() and ar.exception() is not None]
            self.pending = [(r, ar) for r, ar in running if not ar.done()]
            self._raise_for(sorted(failed, key=lambda x: x[0]), what)
        if running:
            self.pending = running
            raise RankTimeout(what, timeout, [r for r, _ in running])
        return [ar.result() for _, ar in submitted]
