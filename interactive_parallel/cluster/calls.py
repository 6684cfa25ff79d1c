"""Remote calls to ranks: submit to each engine, wait with a timeout, fail fast, stream results.

Owns the engine-id -> rank mapping at call time, the timeouts, turning remote exceptions into
RankError / RankTimeout, and the two ways a call's results come back: at its end (`wait`), or
while it runs (`stream`): each rank publishes records with ipyparallel's data publication
(`publish_data`, keyed by a sequence number) and they are read here from each task's `data`
as they arrive. A long call is stopped with ipyparallel's `abort` of the running task, which
the rank sees at its next boundary (see cluster/engine_side.py). While waiting it asks the
caller's `dead()` (ranks whose process is gone) so a killed rank fails the call at once
rather than when the controller's heartbeat notices, and a streaming call fails a rank
that stalls after its peers have finished (`stall`). Knows nothing of models or plans,
and nothing of what the records mean.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Sequence

from .errors import RankError, RankTimeout, remote_error_fields

Submitted = list[tuple[int, Any]]
"""(rank, ipyparallel AsyncResult) of one call, in rank order."""

POLL_S = 0.05
"""How often a streaming call looks for new records: ranks send them at most every 0.1 s
(engine_side.PUBLISH_S), so polling faster only spends client CPU that the ranks share on a
small machine."""
DEATH_POLL_S = 0.1
"""How often a waiting call asks whether a rank's process is gone (a few process-table reads)."""
PEER_GRACE_S = 0.2
"""After one rank failed, how long to wait for its peers' errors (they help) before raising."""
LATE_S = 5.0
"""At most this long, after a call ended with a rank dead, for a record that rank is known to have
sent (an injected fault's announcement) to come through the controller."""


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: no "exception never retrieved" when nobody awaits it


class RankCaller:
    """Calls a function on ranks (engines in rank order) and collects per-rank results."""

    def __init__(self, client, engine_ids: Sequence[int], hosts: Sequence[str] | None = None,
                 dead: Callable[[], list[int]] | None = None):
        self.client = client
        self.engine_ids = list(engine_ids)
        self.hosts = list(hosts or [""] * len(self.engine_ids))
        self.dead = dead or (lambda: [])
        """Ranks whose process is known to be gone (asked while waiting)."""
        self._views = {eid: client[eid] for eid in self.engine_ids}
        self._all = client[self.engine_ids]
        self.pending: Submitted = []
        """A call that failed fast or timed out while some ranks were still running it."""
        self.failed_at = 0.0
        """time.monotonic() when the latest call failed or timed out (pending ranks date from it)."""

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
        """Every rank's result in rank order; the first failure (or a rank's process gone)
        raises at once (RankError)."""
        futs = self._wrap(submitted)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            done, _ = await asyncio.wait(futs, timeout=max(0.0, min(DEATH_POLL_S, left)),
                                         return_when=asyncio.FIRST_EXCEPTION)
            if len(done) == len(futs) or any(f.exception() is not None for f in done) or left <= 0:
                break
            if self._gone(submitted):
                break
        return await self._settle(submitted, timeout, what)

    async def stream(self, submitted: Submitted, on_item: Callable[[int, Any], None], timeout: float,
                     what: str = "call", stall: float | None = None,
                     due: Callable[[], bool] | None = None) -> list[Any]:
        """Like `wait`, but each record a rank publishes is handed to `on_item(rank, record)` as it
        arrives, in the order the rank published it. `timeout` bounds the time without any progress
        (a record or a finished rank), not the whole call: a long run is fine, a stuck one is not.
        `stall`: once some rank has finished, a rank still running with nothing published for
        this long is hung (its peers are not waiting for it, so no collective times out).
        `due`: True while a record a rank sent before dying has not arrived yet; the call then
        keeps reading for up to LATE_S once it has ended (a dead engine is seen from its pid at
        once, while what it published still passes through the controller)."""
        futs = self._wrap(submitted)
        seen: dict[int, set] = {r: set() for r, _ in submitted}
        last = time.monotonic()
        heard = {r: last for r, _ in submitted}
        finished, polls = 0, 0
        stalled: list[int] = []
        while True:
            done, _ = await asyncio.wait(futs, timeout=POLL_S, return_when=asyncio.FIRST_EXCEPTION)
            now = time.monotonic()
            progressed = self._drain(submitted, seen, on_item, final=False)
            for r in progressed:
                heard[r] = now
            if len(done) > finished or progressed:
                finished, last = len(done), now
            failed = any(f.done() and f.exception() is not None for f in futs)
            if failed or len(done) == len(futs) or now - last > timeout:
                break
            polls += 1
            if polls % max(1, round(DEATH_POLL_S / POLL_S)) == 0:
                if self._gone(submitted):
                    break
                if stall is not None and done:
                    stalled = [r for r, ar in submitted if not ar.done() and now - heard[r] > stall]
                    if stalled:
                        break
        await self._outputs_complete([ar for _, ar in submitted if ar.done()])
        self._drain(submitted, seen, on_item, final=True)
        late = time.monotonic() + LATE_S
        while due is not None and due() and time.monotonic() < late:
            await asyncio.sleep(POLL_S)
            self._drain(submitted, seen, on_item, final=False)
        return await self._settle(submitted, timeout, what, stalled=stalled, stall=stall or 0.0)

    def abort(self, submitted: Submitted) -> None:
        """Ask the ranks still running `submitted` to stop at their next boundary (never blocks)."""
        running = [(r, ar) for r, ar in submitted if not ar.done()]
        if running:
            self.client.abort(jobs=[ar for _, ar in running], targets=[self.engine_ids[r] for r, _ in running],
                              block=False)

    async def drain(self, timeout: float, extend: float = 0.0) -> list[int]:
        """Wait for a previous call's stragglers; return the ranks that are still stuck.
        `extend`: each straggler that finishes gives the rest this long again (peers blocked in
        a chain of collectives time out one after another, each from when it began waiting)."""
        if not self.pending:
            return []
        deadline = time.monotonic() + timeout
        futs = self._wrap(self.pending)
        while time.monotonic() < deadline and not all(f.done() for f in futs):
            before = sum(f.done() for f in futs)
            await asyncio.wait(futs, timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_COMPLETED)
            if extend and sum(f.done() for f in futs) > before:
                deadline = max(deadline, time.monotonic() + extend)
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

    def _gone(self, submitted: Submitted) -> list[int]:
        """Ranks of `submitted` still running whose process is gone."""
        running = {r for r, ar in submitted if not ar.done()}
        return [r for r in self.dead() if r in running] if running else []

    def _drain(self, submitted: Submitted, seen: dict[int, set], on_item, final: bool) -> list[int]:
        """Hand on every record not seen yet; the ranks that sent any."""
        got = []
        for rank, ar in submitted:
            data = ar.data  # ipyparallel merges each published dict into the task's data
            fresh = sorted(k for k in list(data) if k not in seen[rank])
            for key in fresh:
                seen[rank].add(key)
                on_item(rank, data[key])
            if fresh:
                got.append(rank)
        return got

    @staticmethod
    async def _outputs_complete(ars: list, limit: float = 5.0) -> None:
        """Published data travels on another channel than the reply and may trail it: wait
        (bounded) until ipyparallel says each finished task's output is complete."""
        deadline = time.monotonic() + limit
        while not all(ar.wait_for_output(0) for ar in ars) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def _raise_for(self, failed: Submitted, what: str, gone: list[int], stalled: list[int], stall: float) -> None:
        others = {}
        for rank, ar in failed:
            e, v, _ = remote_error_fields(ar.exception())
            others[rank] = f"{e}: {v}"
        stuck = [r for r, _ in self.pending if r not in gone]
        if gone or stalled:
            rank = (gone or stalled)[0]
            if gone:
                ename, evalue = "EngineDied", (f"the process of rank {rank} is gone (killed, out of memory or "
                                               "crashed); its peers lost their connections")
            else:
                ename, evalue = "RankHung", (f"rank {rank} sent nothing for {stall:g} s while running {what} "
                                             "after other ranks had finished it")
            others.update({r: "EngineDied: its process is gone" for r in gone[1:]})
            raise RankError(rank, ename, evalue, "", host=self.hosts[rank], what=what, others=others,
                            stuck=[r for r in stuck if r != rank])
        first_rank, first = failed[0]
        ename, evalue, tb = remote_error_fields(first.exception())
        del others[first_rank]
        raise RankError(first_rank, ename, evalue, tb, host=self.hosts[first_rank], what=what, others=others,
                        stuck=stuck)

    async def _settle(self, submitted: Submitted, timeout: float, what: str, stalled: Sequence[int] = (),
                      stall: float = 0.0) -> list[Any]:
        failed = [(r, ar) for r, ar in submitted if ar.done() and ar.exception() is not None]
        running = [(r, ar) for r, ar in submitted if not ar.done()]
        gone = self._gone(submitted)
        if failed or gone or stalled:
            self.failed_at = time.monotonic()
            if running:  # give peers a moment to fail too (their errors help), then leave them running
                await asyncio.wait(self._wrap(running), timeout=PEER_GRACE_S)
            failed += [(r, ar) for r, ar in running if ar.done() and ar.exception() is not None]
            self.pending = [(r, ar) for r, ar in running if not ar.done()]
            self._raise_for(sorted(failed, key=lambda x: x[0]), what, gone, list(stalled), stall)
        if running:
            self.failed_at = time.monotonic()
            self.pending = running
            raise RankTimeout(what, timeout, [r for r, _ in running])
        return [ar.result() for _, ar in submitted]
