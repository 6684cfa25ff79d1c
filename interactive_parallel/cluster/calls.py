"""Remote calls to ranks: submit to each engine, wait with a timeout, fail fast on the first error.

Owns the engine-id -> rank mapping at call time, the timeout, and turning remote
exceptions into RankError / RankTimeout. Knows nothing of models or plans.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time
from typing import Any, Callable, Sequence

from .errors import RankError, RankTimeout, remote_error_fields


class RankCaller:
    """Calls a function on ranks (engines in rank order) and collects per-rank results."""

    def __init__(self, client, engine_ids: Sequence[int], hosts: Sequence[str] | None = None):
        self.client = client
        self.engine_ids = list(engine_ids)
        self.hosts = list(hosts or [""] * len(self.engine_ids))
        self._views = {eid: client[eid] for eid in self.engine_ids}
        self.pending: list[tuple[int, Any]] = []
        """(rank, AsyncResult) of a call that failed fast while other ranks were still running."""

    def submit(self, fn: Callable, args: Sequence[Any] = (), kwargs: dict | None = None, *,
               ranks: Sequence[int] | None = None,
               per_rank: Callable[[int], tuple[tuple, dict]] | None = None) -> list[tuple[int, Any]]:
        out = []
        for rank in (range(len(self.engine_ids)) if ranks is None else ranks):
            a, k = per_rank(rank) if per_rank else (tuple(args), dict(kwargs or {}))
            out.append((rank, self._views[self.engine_ids[rank]].apply_async(fn, *a, **k)))
        return out

    def _raise_for(self, failed: list[tuple[int, Any]], what: str) -> None:
        first_rank, first = failed[0]
        ename, evalue, tb = remote_error_fields(first.exception())
        others = {}
        for rank, ar in failed[1:]:
            e, v, _ = remote_error_fields(ar.exception())
            others[rank] = f"{e}: {v}"
        raise RankError(first_rank, ename, evalue, tb, host=self.hosts[first_rank], what=what, others=others)

    def _settle(self, submitted, done, timeout: float, what: str) -> list[Any]:
        failed = [(r, ar) for r, ar in submitted if ar in done and ar.exception() is not None]
        running = [(r, ar) for r, ar in submitted if ar not in done]
        if failed:
            # Give peers a moment to fail too (their errors help), then leave them running.
            cf.wait([ar for _, ar in running], timeout=0.2)
            failed += [(r, ar) for r, ar in running if ar.done() and ar.exception() is not None]
            self.pending = [(r, ar) for r, ar in running if not ar.done()]
            self._raise_for(sorted(failed, key=lambda x: x[0]), what)
        if running:
            self.pending = running
            raise RankTimeout(what, timeout, [r for r, _ in running])
        return [ar.result() for _, ar in submitted]

    def wait(self, submitted, timeout: float, what: str = "call") -> list[Any]:
        done, _ = cf.wait([ar for _, ar in submitted], timeout=timeout, return_when=cf.FIRST_EXCEPTION)
        return self._settle(submitted, done, timeout, what)

    async def wait_async(self, submitted, timeout: float, what: str = "call") -> list[Any]:
        # The blocking wait runs in a worker thread: the caller's loop (a notebook kernel)
        # stays free, and no asyncio future is left holding an unretrieved exception.
        loop = asyncio.get_running_loop()
        done, _ = await loop.run_in_executor(None, lambda: cf.wait(
            [ar for _, ar in submitted], timeout=timeout, return_when=cf.FIRST_EXCEPTION))
        return self._settle(submitted, done, timeout, what)

    def drain(self, timeout: float) -> list[int]:
        """Wait for a previous call's stragglers; return the ranks that are still stuck."""
        if not self.pending:
            return []
        deadline = time.monotonic() + timeout
        cf.wait([ar for _, ar in self.pending], timeout=max(0.0, deadline - time.monotonic()))
        stuck = [r for r, ar in self.pending if not ar.done()]
        self.pending = [(r, ar) for r, ar in self.pending if not ar.done()]
        return stuck
