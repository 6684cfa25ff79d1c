"""Records of a layout's state: where it came from when laid out, what a save or snapshot wrote,
and the scratch directory's parts both sides name.

Knows nothing of torch, ipyparallel or plotly (records/base.py has the dict mechanism), nor of
the file formats written under those paths (runtime/checkpoints/checkpoint.py).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from .base import Record
from .lint import LintFinding


class RestoreSource(StrEnum):
    """Where a laid-out model's weights, optimizer state and step came from."""

    SEED = "seed"
    """Fresh from the plan's seed (nothing to carry, or nothing survived)."""
    CARRIED = "carried"
    """From the layout that was there (a re-plan, resharded through the scratch directory)."""
    KEPT = "kept"
    """Each rank's own shards, kept in memory across a re-formed process group."""
    SNAPSHOT = "snapshot"
    """The newest recovery snapshot under the scratch directory."""


@dataclass
class LayoutInfo(Record):
    """What apply_plan did on one rank: its mesh coordinates, where its state came from, its step,
    and what the layout lint found in it."""

    kind: ClassVar[str] = "layout_info"
    coords: dict[str, int]
    """Mesh axis name -> this rank's coordinate on it."""
    state: RestoreSource
    step: int
    findings: list[LintFinding] = field(default_factory=list)
    """What the layout lint (runtime.layout.lint) found in the layout just built on this rank."""


@dataclass
class SaveInfo(Record):
    """What a checkpoint save or load wrote or read."""

    kind: ClassVar[str] = "save_info"
    path: str
    tensors: int
    """Model tensors in the checkpoint."""
    optimizer: bool
    """Whether it holds optimizer state (an optimizer that never stepped has none)."""
    step: int
    plan: str
    """The plan of the layout that wrote or read it (Plan.describe())."""


@dataclass
class SnapshotInfo(Record):
    """One recovery snapshot as written by one rank."""

    kind: ClassVar[str] = "snapshot_info"
    path: str
    step: int
    seconds: float
    bytes: int
    """Bytes this rank's replica wrote."""


SCRATCH_BASE_ENV = "IP_SCRATCH_BASE"


def scratch_base() -> str:
    """Where a fresh scratch directory is made: $IP_SCRATCH_BASE when set (a container whose
    /dev/shm is too small, a test worker that keeps its files apart), else the host's tmpfs
    (/dev/shm: it outlives a killed rank process and costs no disk), else the system's temporary
    directory."""
    given = os.environ.get(SCRATCH_BASE_ENV)
    if given:
        os.makedirs(given, exist_ok=True)
        return given
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


@dataclass(frozen=True)
class ScratchLayout(Record):
    """The session's scratch directory and its parts, named once for client and ranks: the
    client sends this record, each side joins paths through it."""

    kind: ClassVar[str] = "scratch_layout"
    root: str

    @property
    def snapshots(self) -> str:
        """Recovery snapshots, one folder a generation (runtime/checkpoints/checkpoint.py)."""
        return os.path.join(self.root, "snapshots")

    @property
    def replan(self) -> str:
        """The layout being re-planned, in parts every rank of the new layout reads."""
        return os.path.join(self.root, "replan")

    @property
    def compile_cache(self) -> str:
        """Inductor's cache of compiled blocks under Plan(compile=True) (runtime/parallel/compile.py)."""
        return os.path.join(self.root, "compile")

    @property
    def shared_token(self) -> str:
        """The file the client writes to ask ranks on other hosts whether they share the root."""
        return os.path.join(self.root, ".shared")
