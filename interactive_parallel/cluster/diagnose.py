"""What a failed call means: from the errors the ranks raised and what was seen around them,
the one error to show, naming the rank behind the failure and the injected fault that caused it.

Owns the reading of ranks' error text (a peer's process gone, a collective timed out), the
naming rules (a dead rank over the peers that lost their connection to it; the rank still
running over the peers that gave up waiting for it; the rank that announced skipping a
collective when all of them timed out together; the pool's controller over every rank), and
how long stragglers of the failed call may still take. Pure: it waits for nothing and calls
no rank, so every rule is tested on sample errors (tests/test_diagnose.py); the rank set
gathers the `Evidence` first (cluster/rankset.py). Knows nothing of ipyparallel or torch,
the way ipyparallel's `error.collect_exceptions` folds many engines' errors into one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..records import FaultSpec
from ..records.stacks import CollectiveRecord, StackRecord, first_mismatch, groups_of
from .errors import RankError

LOST = re.compile(r"Connection (reset|closed)|Broken pipe|EOF|Socket closed|peer|remote process exit|ncclRemoteError"
                  r"|communicator was aborted", re.I)
"""What a rank's error says when a peer's process went away under it (gloo's words, and NCCL's
when a remote rank exited or its communicator was aborted after a peer's failure)."""
TIMED_OUT = re.compile(r"timed? ?out|timing out", re.I)
"""What a rank's error says when it gave up waiting in a collective (NCCL's watchdog: "caught
collective operation timeout ... before timing out")."""
STUCK_MARGIN_S = 3.0
"""How long after its peers' collectives timed out a rank may still be busy before it counts as
hung: peers blocked in the same step give up within about a step of each other."""


def said(exc: RankError) -> list[str]:
    """What every failed rank of `exc` said, the first one's whole error included."""
    return [f"{exc.ename}: {exc.evalue}", *exc.others.values()]


def first_line(ename: str, evalue: str) -> str:
    return f"{ename}: {(evalue.splitlines() or [''])[0][:200]}"


def lost_peer(exc: RankError) -> bool:
    """Some rank lost its connection to a peer (whose process may be gone)."""
    return any(LOST.search(x) for x in said(exc))


def timed_out(exc: RankError) -> bool:
    """Some rank gave up waiting in a collective (or was named hung)."""
    return exc.ename == "RankHung" or any(TIMED_OUT.search(x) for x in said(exc))


def gave_up(exc: RankError, dead: list[int]) -> bool:
    """Some rank gave up waiting in a collective: it timed out, or it lost a peer whose process
    is alive (gloo closes a timed-out rank's pairs, so a peer still waiting sees its connection
    close a moment before its own timeout would have fired)."""
    return timed_out(exc) or (not dead and lost_peer(exc))


def group_broken(exc: RankError, left_running: bool) -> bool:
    """The process group is no use after this failure: a rank was left running in it, or one
    gave up on a collective or lost a peer (gloo closes its pairs after a timeout, so even
    ranks that all returned together share no working group)."""
    return left_running or timed_out(exc) or lost_peer(exc)


def wait_for_hung(exc: RankError, dead: list[int]) -> bool:
    """Worth waiting (up to STUCK_MARGIN_S) for the other blocked peers to time out too, so the
    rank still running after them can be named hung."""
    return not dead and gave_up(exc, dead) and bool(exc.stuck) and exc.ename != "RankHung"


@dataclass(frozen=True)
class Evidence:
    """What the rank set saw around a failed call, gathered before it is explained."""

    hosts: list[str]
    """Host of each rank, in rank order."""
    collective_timeout: float
    dead: list[int] = field(default_factory=list)
    """Ranks whose process is gone (after waiting for a death behind a lost connection)."""
    hung: list[int] | None = None
    """Ranks still running once blocked peers had time to time out too (None: not waited for)."""
    finished: dict[int, str] = field(default_factory=dict)
    """Ranks that raised while that wait ran: their first error line."""
    fired: list[FaultSpec] = field(default_factory=list)
    """Injected faults that announced themselves during the call."""
    armed: list[FaultSpec] = field(default_factory=list)
    """Injected faults armed for the call (fired or not)."""
    controller_gone: bool = False
    """The pool's ipyparallel controller (a process of ours) has ended."""
    controller_pid: int | None = None
    collectives: list[CollectiveRecord] = field(default_factory=list)
    """After a timed-out collective: each rank's latest collectives per group (flight recorder)."""
    stacks: list[StackRecord] = field(default_factory=list)
    """After a timed-out collective: the stacks of the ranks still running the call."""


@dataclass(frozen=True)
class Diagnosis:
    error: RankError
    patience: float
    """Seconds (from the failure) the call's stragglers may still take before they count as stuck."""


def explain(exc: RankError, ev: Evidence) -> Diagnosis:
    """The error to show for a failed call, and how long its stragglers may take."""
    patience = ev.collective_timeout + STUCK_MARGIN_S
    if ev.controller_gone:
        return Diagnosis(_controller_died(exc, ev), 0.0)
    waited_out = gave_up(exc, ev.dead)
    if ev.dead and exc.rank not in ev.dead:
        exc = _engine_died(exc, ev)
    elif not ev.dead and waited_out and ev.hung:
        exc = _rank_hung(exc, ev)
    if not ev.dead and waited_out and exc.ename not in ("RankHung", "SkippedCollective"):
        exc = _skipper(exc, ev)
    if waited_out and not ev.dead:
        patience = 0.0 if exc.ename == "RankHung" else STUCK_MARGIN_S
    named = {exc.rank, *exc.stuck, *exc.others}
    culprits = ([f for f in ev.fired if f.rank in named] or ev.fired
                or [f for f in ev.armed if f.rank in named] or ev.armed)
    if culprits:
        exc = exc.with_fault("; ".join(f.describe() for f in culprits))
    if waited_out and (ev.collectives or ev.stacks):
        exc = exc.with_where(where_text(ev.collectives, ev.stacks), first_mismatch(ev.collectives), ev.collectives,
                             ev.stacks)
    return Diagnosis(exc, patience)


def where_text(collectives: list[CollectiveRecord], stacks: list[StackRecord]) -> str:
    """Lines for the error: the first mismatch (records/stacks.py's `first_mismatch`), each
    group's latest collective per rank (ranks alike folded), and where each rank still running is."""
    lines = []
    found = first_mismatch(collectives)
    if found:
        lines.append(f"  first mismatch {found.describe()}")
    groups = groups_of(collectives)
    for group, members, p2p in sorted(groups, key=lambda k: (k[0] != "world", k)):
        alike: dict[tuple, list[int]] = {}
        for r, seqs in sorted(groups[group, members, p2p].items()):
            c = seqs[max(seqs)]
            alike.setdefault((c.seq, c.op, c.state), []).append(r)
        lines.append(f"  latest {'point-to-point ' if p2p else ''}on {group} {list(members)}: " + "; ".join(
            f"rank(s) {rs} #{seq} {op} {state}" for (seq, op, state), rs in alike.items()))
    for s in stacks:
        if s.frames:
            path = s.module_path()
            lines.append(f"  rank {s.rank} still running: {s.state} at {s.where}"
                         + (f" (modules {' > '.join(path)})" if len(path) > 1 else ""))
    return "\n".join(lines)


def _others(exc: RankError) -> dict[int, str]:
    return {exc.rank: first_line(exc.ename, exc.evalue), **exc.others}


def _engine_died(exc: RankError, ev: Evidence) -> RankError:
    """A rank died: its peers' "connection closed" came first; name the dead rank instead."""
    rank = ev.dead[0]
    others = {**exc.others, exc.rank: first_line(exc.ename, exc.evalue)}
    return RankError(rank, "EngineDied", f"the process of rank {rank} is gone (killed, out of memory or crashed); "
                     "its peers lost their connections", "", host=ev.hosts[rank], what=exc.what, others=others,
                     stuck=[r for r in exc.stuck if r not in ev.dead])


def _rank_hung(exc: RankError, ev: Evidence) -> RankError:
    """Peers timed out in a collective; the ranks still running after them are the ones they
    waited for."""
    rank = ev.hung[0]
    others = {**_others(exc), **ev.finished}
    return RankError(rank, "RankHung", f"rank {rank} was still running {exc.what} after its peers gave up waiting "
                     f"for it in a collective ({ev.collective_timeout:g} s): it hung, or never reached that "
                     "collective", "", host=ev.hosts[rank], what=exc.what, others=others, stuck=ev.hung[1:])


def _skipper(exc: RankError, ev: Evidence) -> RankError:
    """Every rank timed out together (none was left running to name as hung): when one of them
    announced that it skipped a collective (an injected fault), that rank is the one they all
    waited for, whichever of them failed first."""
    skipped = [f.rank for f in ev.fired if f.fault == "skip_collective"]
    if not skipped or skipped[0] == exc.rank:
        return exc
    rank = skipped[0]
    others = _others(exc)
    others.pop(rank, None)
    return RankError(rank, "SkippedCollective", f"rank {rank} skipped a collective its peers issued, so every "
                     f"rank's later collectives were mismatched and timed out ({ev.collective_timeout:g} s)", "",
                     host=ev.hosts[rank], what=exc.what, others=others, stuck=exc.stuck)


def _controller_died(exc: RankError, ev: Evidence) -> RankError:
    """The local controller is gone: no message reaches or leaves any rank, whatever they said
    (the "gone" its loss made every rank look is left out; what ranks raised themselves stays)."""
    pid = f" (pid {ev.controller_pid})" if ev.controller_pid else ""
    return RankError(exc.rank, "ControllerDied", f"the pool's ipyparallel controller{pid} is gone, so no call "
                     "reaches the ranks; the next call starts a new pool and resumes from the newest snapshot "
                     "(or call restart_ranks())", "", host=exc.host, what=exc.what,
                     others={} if exc.ename == "EngineDied" else exc.others, stuck=[])
