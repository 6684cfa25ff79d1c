"""Where each rank is right now: its threads' Python stacks, and the collectives its groups issued.

Owns `FrameRecord` (one frame: file, line, function, its source line, and two flags: the
package's own code, and the model module it runs in), `StackRecord` (one thread of one rank,
innermost frame last; a rank that did not answer is a StackRecord with `error` set, so every
rank of the session has a row) and `CollectiveRecord` (one collective as a rank's process
group saw it: the group's sequence number, op, sizes, state and the frame that issued it), and
the first collective a group's members disagree on (`first_mismatch` -> `Mismatch`: pure, over
the records of every rank, as torch's flight recorder analyzer compares its dumps; the error of
a timed-out call and a figure read it).
Built on the ranks (runtime/probes/stacks.py, runtime/probes/recorder.py), sent as dicts over
ipyparallel's control channel or pickled like every record. Knows nothing of torch,
ipyparallel or how a stack is read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .base import Record

RECORDER_ENTRIES = 2000
"""Collectives torch's flight recorder keeps per rank (all its groups together) unless told
otherwise: a few steps of a small model under any plan (tiny-llama: 10-60 a step; a 32-layer
model under fsdp x tp a few hundred). Read by the Session's default and by a torchrun start."""
STACK_COLUMNS = ("rank", "thread", "state", "collective", "where", "error")
COLLECTIVE_COLUMNS = ("rank", "group", "ranks", "seq", "op", "state", "in_sizes", "out_sizes", "where")


@dataclass
class FrameRecord(Record):
    """One frame of a stack."""

    kind: ClassVar[str] = "frame"
    file: str
    line: int
    function: str
    code: str = ""
    """The source line it is at ('' when the file cannot be read)."""
    own: bool = False
    """The frame is interactive_parallel's own code."""
    module: str = ""
    """The model module (its path in the model, as layout() and the comm causes name it) whose
    method this frame runs; '' outside the model's modules."""

    @property
    def in_model(self) -> bool:
        return bool(self.module)

    def short(self) -> str:
        """'file.py:120 in forward [model.layers.3.mlp]'."""
        where = f"{self.file.rsplit('/', 1)[-1]}:{self.line} in {self.function}"
        return f"{where} [{self.module}]" if self.module else where


@dataclass
class StackRecord(Record):
    """One thread of one rank, when it was asked (outermost frame first, innermost last)."""

    kind: ClassVar[str] = "stack"
    rank: int
    thread: str = ""
    """The thread's name ('MainThread' runs the ranks' calls)."""
    main: bool = False
    """The thread that runs the session's calls (train, run, ...)."""
    frames: list[FrameRecord] = field(default_factory=list)
    """Frames inside the running call (the engine's own loop below it left out); [] when idle."""
    collective: str = ""
    """The torch.distributed call it waits in ('all_reduce', 'barrier', ...); '' when none."""
    time: float = 0.0
    """When it was read (the rank's clock, seconds since the epoch)."""
    error: str = ""
    """Why there is no stack: the rank did not answer in time, its process is gone, ..."""

    @property
    def state(self) -> str:
        """'no answer' / 'idle' / 'in <collective>' / 'running'."""
        if self.error:
            return "no answer"
        if not self.frames:
            return "idle"
        return f"in {self.collective}" if self.collective else "running"

    @property
    def where(self) -> str:
        """The innermost frame that is the user's, the model's or the package's own (not torch's
        nor the standard library's), shortened; '' when idle."""
        for f in reversed(self.frames):
            if f.own or f.module or not _library(f.file):
                return f.short()
        return self.frames[-1].short() if self.frames else ""

    def module_path(self) -> list[str]:
        """The model modules on the stack, outermost first."""
        out: list[str] = []
        for f in self.frames:
            if f.module and (not out or out[-1] != f.module):
                out.append(f.module)
        return out


def _library(path: str) -> bool:
    """A file of an installed library or the standard library (not the user's, not a notebook's)."""
    return "site-packages" in path or "/lib/python3" in path or path.startswith("<frozen")


@dataclass
class CollectiveRecord(Record):
    """One collective of one process group on one rank, as the group's own sequence counts it."""

    kind: ClassVar[str] = "collective"
    rank: int
    group: str
    """The group's name as the session's layout calls it ('world', 'dp', 'tp', ...; torch's
    own name when no mesh axis matches)."""
    seq: int
    """The group's collective sequence number on this rank (every rank of a group counts the
    same collectives: a rank behind its peers shows a smaller number)."""
    op: str
    ranks: list = field(default_factory=list)
    """The global ranks of the group ([] when unknown): under dp x tp two ranks' 'tp' groups may
    be different groups."""
    p2p: bool = False
    """A send / recv: `seq` then counts the group's point-to-point ops, apart from its collectives."""
    state: str = ""
    """'scheduled', 'started' or 'completed' (torch's flight recorder's words; under gloo every
    entry stays 'scheduled': there the sequence numbers say who is behind)."""
    in_sizes: list = field(default_factory=list)
    out_sizes: list = field(default_factory=list)
    dtype: str = ""
    where: str = ""
    """The frame that issued it outside torch (file:line in function)."""
    time: float = 0.0
    """When it was issued (the rank's clock, seconds since the epoch; 0 when unknown)."""


@dataclass(frozen=True)
class Mismatch:
    """The first collective (or point-to-point op) a process group's members disagree on."""

    group: str
    members: tuple
    """The group's global ranks (the ranks that answered, when the group did not say)."""
    seq: int
    issued: dict
    """(op, input sizes, state) -> the ranks that issued that as number `seq`."""
    behind: dict
    """rank -> its latest number, for the ranks that never issued number `seq`."""
    p2p: bool = False
    """The numbers count the group's sends and receives (only who is behind is compared then)."""
    time: float = 0.0
    """When the first rank issued number `seq` (its clock): the earliest mismatch comes first."""

    def describe(self) -> str:
        """"on group 'dp' [0, 1, 2, 3] at #58: rank(s) [1] never issued it (latest #57); rank(s)
        [0, 2, 3] issued all_reduce [[256]] (scheduled)"."""
        parts = [f"rank(s) {sorted(self.behind)} never issued it (latest "
                 + ", ".join(f"#{s}" for s in sorted(set(self.behind.values()))) + ")"] if self.behind else []
        parts += [f"rank(s) {ranks} issued {op} {sizes} ({state})" for (op, sizes, state), ranks in self.issued.items()]
        where = "point-to-point op" if self.p2p else "collective"
        return f"on group {self.group!r} {list(self.members)} at {where} #{self.seq}: " + "; ".join(parts)


def groups_of(collectives: list[CollectiveRecord]) -> dict[tuple, dict[int, dict[int, CollectiveRecord]]]:
    """(group, members, p2p) -> rank -> number -> its record: a group's collectives and its
    point-to-point ops apart (each counted on its own)."""
    out: dict[tuple, dict[int, dict[int, CollectiveRecord]]] = {}
    for c in collectives:
        out.setdefault((c.group, tuple(c.ranks), c.p2p), {}).setdefault(c.rank, {})[c.seq] = c
    return out


def first_mismatch(collectives: list[CollectiveRecord]) -> Mismatch | None:
    """The earliest collective (by when it was issued) that a group's members disagree on: some
    never issued it (they are behind, or stuck elsewhere), or they issued different ops or sizes
    under that number (a rank that skipped one pairs its next with its peers' wait). Point-to-point
    ops are compared by count only (a send and its receive differ by nature). Compared over the
    numbers every member still holds; None when every group agrees."""
    found = []
    for (group, members, p2p), per_rank in groups_of(collectives).items():
        start = max(min(seqs) for seqs in per_rank.values())
        for seq in range(start, max(max(seqs) for seqs in per_rank.values()) + 1):
            issued: dict[tuple, list[int]] = {}
            for r, seqs in sorted(per_rank.items()):
                if seq in seqs:
                    issued.setdefault((seqs[seq].op, str(seqs[seq].in_sizes), seqs[seq].state), []).append(r)
            if not issued:
                continue  # a number no member holds (the ring dropped it everywhere): nothing to compare
            behind = {r: max(seqs) for r, seqs in per_rank.items() if seq not in seqs}
            if behind or (not p2p and len({(op, sizes) for op, sizes, _ in issued}) > 1):
                when = min(per_rank[rs[0]][seq].time for rs in issued.values())
                found.append(Mismatch(group, members or tuple(sorted(per_rank)), seq,
                                      dict(sorted(issued.items(), key=lambda kv: -len(kv[1]))), behind, p2p, when))
                break
    found.sort(key=lambda m: (m.time, m.group != "world", m.group, m.members))
    return found[0] if found else None
