"""Where each rank is right now: its threads' Python stacks, and the collectives its groups issued.

Owns `FrameRecord` (one frame: file, line, function, its source line, and two flags: the
package's own code, and the model module it runs in), `StackRecord` (one thread of one rank,
innermost frame last; a rank that did not answer is a StackRecord with `error` set, so every
rank of the session has a row) and `CollectiveRecord` (one collective as a rank's process
group saw it: the group's sequence number, op, sizes, state and the frame that issued it).
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
COLLECTIVE_COLUMNS = ("rank", "group", "seq", "op", "state", "in_sizes", "out_sizes", "where")


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
