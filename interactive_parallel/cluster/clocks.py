"""Each rank's clock against this client's, measured NTP-style over the calls that reach them.

Owns the measurement (the rank's time.time() against the midpoint of the round trip that
fetched it, from the round with the shortest trip: its error is at most half that trip) and
nothing else: records are put on the client's clock by cluster/telemetry.py. Knows nothing of
pools or torch; it is handed the call that reaches every rank.
"""
from __future__ import annotations

import time
from typing import Awaitable, Callable, Sequence

from ..records import ClockRecord
from ..runtime import api

CLOCK_COLUMNS = ("rank", "host", "offset_s", "rtt_s")
CLOCK_ROUNDS = 5
"""Round trips per measurement: a few ride out a scheduling hiccup of the client or an engine."""


async def measure(call: Callable[..., Awaitable[list]], hosts: Sequence[str],
                  rounds: int = CLOCK_ROUNDS) -> list[ClockRecord]:
    """One ClockRecord per rank; `call(fn, what=...)` runs fn on every rank, results in rank order."""
    best: dict[int, tuple[float, float]] = {}
    for _ in range(rounds):
        t0 = time.time()
        remote = await call(api.wall_clock, what="clock")
        t1 = time.time()
        for rank, t in enumerate(remote):
            if rank not in best or t1 - t0 < best[rank][1]:
                best[rank] = (t - (t0 + t1) / 2, t1 - t0)
    return [ClockRecord(rank=r, host=hosts[r], offset_s=o, rtt_s=rtt) for r, (o, rtt) in sorted(best.items())]
