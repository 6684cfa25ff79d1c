"""Errors the client raises for what happened on ranks.

Owns turning an ipyparallel RemoteError into an exception that names the rank (not the
engine id) and carries the rank's traceback as text. Knows nothing of torch.
"""
from __future__ import annotations

import re
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class RankError(RuntimeError):
    """An exception raised on one or more ranks; `.rank`, `.ename`, `.traceback` of the first."""

    def __init__(self, rank: int, ename: str, evalue: str, traceback: str, *, host: str = "", what: str = "",
                 others: dict[int, str] | None = None, stuck: list[int] | None = None, fault: str = "",
                 where: str = "", mismatch: Any = None, collectives: list | None = None,
                 stacks: list | None = None):
        self.rank, self.ename, self.evalue, self.traceback = rank, ename, evalue, traceback
        self.host, self.what, self.others = host, what, dict(others or {})
        self.stuck = list(stuck or [])
        """Ranks still running the call when it failed (blocked in a collective, or hung)."""
        self.fault = fault
        """The injected fault behind the failure, when one was armed (Session.inject)."""
        self.where = where
        """Where the ranks were (a timed-out collective): each rank's latest collective per group
        as torch's flight recorder counts them, the first mismatch marked, and the stacks of
        ranks still running (cluster/diagnose.py's `where_text`)."""
        self.mismatch = mismatch
        """The first collective a group's members disagree on (records.stacks.Mismatch: which
        ranks issued sequence number `seq` on which group, which never did), or None."""
        self.collectives = list(collectives or [])
        """The CollectiveRecords `where` was read from (each rank's latest per group, as the call
        failed: the group is re-formed after it): viz.collective_lanes_figure draws them."""
        self.stacks = list(stacks or [])
        """The StackRecords of the ranks still running the call when it failed."""
        who = f"rank {rank}" + (f" ({host})" if host else "")
        head = f"{who} raised {ename}: {evalue}" + (f" during {what}" if what else "")
        more = "".join(f"\n  also rank {r}: {msg}" for r, msg in sorted(self.others.items()))
        if self.stuck:
            more += f"\n  rank(s) {self.stuck} had not finished (hung, or waiting in a collective)"
        if fault:
            more += f"\n  injected fault: {fault}"
        if where:
            more += "\n" + where
        super().__init__(f"{head}{more}\n--- traceback from rank {rank} ---\n{traceback}")

    def _with(self, **changes: Any) -> "RankError":
        kept = dict(host=self.host, what=self.what, others=self.others, stuck=self.stuck, fault=self.fault,
                    where=self.where, mismatch=self.mismatch, collectives=self.collectives, stacks=self.stacks)
        return RankError(self.rank, self.ename, self.evalue, self.traceback, **{**kept, **changes})

    def with_fault(self, fault: str) -> "RankError":
        """The same error, naming the injected fault that caused it."""
        return self._with(fault=fault)

    def with_where(self, where: str, mismatch: Any = None, collectives: list | None = None,
                   stacks: list | None = None) -> "RankError":
        """The same error, saying where the ranks were (and the records it was read from)."""
        return self._with(where=where, mismatch=mismatch, collectives=list(collectives or []), stacks=list(stacks or []))


class RankTimeout(TimeoutError):
    """A remote call did not finish on every rank in time; `.pending` lists the ranks still busy."""

    def __init__(self, what: str, timeout: float, pending: list[int]):
        self.what, self.timeout, self.pending = what, timeout, pending
        super().__init__(f"{what} did not finish within {timeout:g} s on rank(s) {pending}; "
                         "a rank may be blocked in a collective its peers never issued")


class SessionError(RuntimeError):
    """Misuse of the session itself (stopped, no model, a call already running)."""


def remote_error_fields(exc: BaseException) -> tuple[str, str, str]:
    """(ename, evalue, traceback text) of an ipyparallel RemoteError or a local exception."""
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None) or str(exc)
    tb = getattr(exc, "traceback", None)
    if isinstance(tb, list):
        tb = "\n".join(tb)
    if not tb:
        import traceback as _tb

        tb = "".join(_tb.format_exception(exc))
    return ename, str(evalue), _ANSI.sub("", tb)
