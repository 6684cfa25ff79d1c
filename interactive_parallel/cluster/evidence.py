"""What is gathered about a failed call before it is explained (cluster/diagnose.py names it).

Owns the short waits that make the naming right: for an injected fault's announcement that a
dead rank sent but the controller has not passed on yet (`announcement_due`), for a dead process behind a lost
connection (on another host only the controller's heartbeat sees it; a process of our own
pool is seen at once), and for blocked peers to time out too, so the rank still running after
them can be named hung; and, after a timed-out collective, asking where the ranks are (their
latest collectives as torch's flight recorder counts them, the stacks of those still running). Also owns `Witness`, what those waits read of a rank set (its caller,
its dead processes, the faults armed and fired), declared here so that cluster/rankset.py,
which gathers the evidence, is not imported back. Knows nothing of models or of the rank set
beyond that.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol, Sequence

from ..records import FaultSpec
from . import diagnose
from .calls import RankCaller
from .diagnose import STUCK_MARGIN_S, Evidence
from .errors import RankError, remote_error_fields

LAST_COLLECTIVES = 64
"""Per rank and group, the collectives a timed-out call's error compares (the first mismatch may
lie a few collectives back: a rank that skipped one goes on pairing its next ones with its peers')."""
DEATH_WAIT_S = 4.0
"""After a peer's connection dropped, how long to look for a dead engine behind it."""


class Witness(Protocol):
    """What the evidence of a failed call is read from: the rank set (cluster/rankset.py) is one."""

    caller: RankCaller | None
    pool: Any
    """The pool (where the ranks are asked through its client's control channel: cluster/where.py)."""
    collective_timeout: float
    faults: list[FaultSpec]
    """Faults armed for the call that failed."""
    fired: list[FaultSpec]
    """Faults that fired during it."""

    def dead_ranks(self) -> list[int]: ...

    def mark_gone(self, ranks: Sequence[int]) -> None: ...

    def controller_gone(self) -> bool: ...

    def controller_pid(self) -> int | None: ...


def announcement_due(ranks: Witness) -> bool:
    """An armed fault on a rank now gone whose announcement has not arrived: the rank handed it
    to its transport before the fault acted, so it is still on its way."""
    gone, heard = ranks.dead_ranks(), {(f.rank, f.fault) for f in ranks.fired}
    return any(f.rank in gone and (f.rank, f.fault) not in heard for f in ranks.faults)


async def gather_evidence(ranks: Witness, exc: RankError) -> Evidence:
    dead = ranks.dead_ranks()
    if not dead and diagnose.lost_peer(exc):
        for _ in range(int(DEATH_WAIT_S / 0.05)):
            dead = ranks.dead_ranks()
            if dead or ranks.caller is None:
                break
            await asyncio.sleep(0.05)
    if dead:
        ranks.mark_gone(dead)
    hung, finished = None, {}
    if diagnose.wait_for_hung(exc, dead):
        hung, finished = await still_running(ranks)
    gone = ranks.controller_gone()
    collectives, stacks = await where_they_are(ranks) if diagnose.gave_up(exc, dead) and not gone else ([], [])
    return Evidence(hosts=list(ranks.caller.hosts), collective_timeout=ranks.collective_timeout, dead=dead,
                    hung=hung, finished=finished, fired=list(ranks.fired), armed=list(ranks.faults),
                    controller_gone=gone, controller_pid=ranks.controller_pid(), collectives=collectives,
                    stacks=stacks)


async def where_they_are(ranks: Witness) -> tuple[list, list]:
    """After a timed-out collective: each rank's latest collectives per group, and the stacks of
    the ranks still running (asked on their control threads: cluster/where.py); what cannot be
    had is left out, never raised: the error being explained matters more."""
    from . import where

    try:  # both asked at once: each waits at most where.ANSWER_S for a rank that does not answer
        (collectives, _), stacks = await asyncio.gather(where.collectives(ranks, LAST_COLLECTIVES), where.stacks(ranks))
    except Exception:  # noqa: BLE001 - evidence is best effort
        return [], []
    return list(collectives), [s for s in stacks if s.frames]


async def still_running(ranks: Witness) -> tuple[list[int], dict[int, str]]:
    """Wait (up to STUCK_MARGIN_S) while more than one straggler runs; then the ranks still
    running (left pending on the caller), and the first error line of those that failed meanwhile."""
    pending = ranks.caller.pending
    deadline = time.monotonic() + STUCK_MARGIN_S
    while time.monotonic() < deadline and sum(not ar.done() for _, ar in pending) > 1:
        await asyncio.sleep(0.05)
    finished = {r: diagnose.first_line(*remote_error_fields(ar.exception())[:2])
                for r, ar in pending if ar.done() and ar.exception() is not None}
    hung = [r for r, ar in pending if not ar.done()]
    if hung:
        ranks.caller.pending = [(r, ar) for r, ar in pending if not ar.done()]
    return hung, finished
