"""What the layout lint found: one record per parameter (or module), mesh axis and kind of fault.

Owns `LintFinding` and the closed sets it draws from (`LintKind`, `LintSeverity`).
runtime.layout.lint builds them on each rank from the laid-out model's placements; the Session
merges the ranks' (`merged`: one record per finding, the ranks that hold it listed). Knows nothing of
torch, of how a layout is read or of how findings are shown.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import ClassVar, Iterable

from .base import Record


class LintKind(StrEnum):
    """What will go wrong."""

    GRAD_NOT_REDUCED = "grad_not_reduced"
    """A gradient that nothing sums over an axis its inputs vary on: the replicas drift apart."""
    REDUCED_TWICE = "reduced_twice"
    """A gradient summed over an axis twice (DTensor's own reduction and a hook): tp times too large."""
    PARTIAL_OUTPUT = "partial_output"
    """A module hands on a partial sum over an axis as a plain tensor: the next non-linear op reads it unsummed."""
    SPLIT_FUSED = "split_fused"
    """A fused [q | k | v] projection split on its output features without regrouping per head:
    a rank's shard holds the wrong heads' queries, keys and values."""
    IMPLICIT_REDISTRIBUTE = "implicit_redistribute"
    """DTensor's sharding propagation will redistribute it every step, a collective no module asked for
    (numbers right, traffic added)."""
    WHOLE_EACH_STEP = "whole_each_step"
    """A style moves a whole tensor every step where another keeps it local (numbers right, traffic added)."""
    NOT_DIVISIBLE = "not_divisible"
    """A sharded dim the axis does not divide: the shards differ in size."""


class LintSeverity(StrEnum):
    WRONG = "wrong"
    """The step's numbers will differ from one process's."""
    COST = "cost"
    """The numbers are right; the layout moves or pads more than it needs."""


@dataclass
class LintFinding(Record):
    """One thing the layout lint says will go wrong: where, on which mesh axis, why, and the fix."""

    kind: ClassVar[str] = "lint"
    param: str
    """The parameter's name in the model (or a module's path, for a module-level fault)."""
    axis: str
    """The mesh axis it goes wrong on ('tp', 'dp', 'fsdp', 'cp')."""
    fault: str
    """A LintKind value."""
    severity: str
    """A LintSeverity value."""
    why: str
    """One line: what will happen and why."""
    fix: str
    """One line: what to change."""
    ranks: list[int] = field(default_factory=list)
    """The ranks whose layout holds it."""

    def __str__(self) -> str:
        return f"{self.severity}: {self.param} on {self.axis}: {self.fault}: {self.why} (fix: {self.fix})"


LINT_COLUMNS = ("severity", "fault", "param", "axis", "ranks", "why", "fix")
"""The columns a RecordList of findings prints."""


def merged(findings: Iterable[LintFinding]) -> list[LintFinding]:
    """The ranks' findings as one list: a finding several ranks made is one record listing them,
    the faults that make numbers wrong first, then in the order first seen."""
    out: dict[tuple, LintFinding] = {}
    for f in findings:
        key = (f.param, f.axis, f.fault, f.severity, f.why, f.fix)
        if key in out:
            out[key].ranks = sorted(set(out[key].ranks) | set(f.ranks))
        else:
            out[key] = replace(f, ranks=sorted(f.ranks))
    return sorted(out.values(), key=lambda f: f.severity != LintSeverity.WRONG)
