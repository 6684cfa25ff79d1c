"""What a part of the panel tells the panel: a closed set of small typed events.

Owns the events and the kinds of long job. A section, the job runner or the dry view raises
an event through the `emit` callable it was given at construction and never learns who
listens: only widgets/panel.py subscribes, and it alone decides what each event redraws.
Knows nothing of sections, widgets or sessions beyond the one value an event carries.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable


class JobKind(StrEnum):
    """The long calls that run as the panel's Job (one at a time; Stop ends any of them)."""

    TRAIN = "train"
    GENERATE = "generate"
    SERVE = "serve"

    @property
    def activity(self) -> str:
        """What the ranks are doing meanwhile, as the Cluster section's status says it."""
        return {"train": "training", "generate": "generating", "serve": "serving"}[self.value]


@dataclass(frozen=True)
class SessionChosen:
    """The Cluster section started, attached to or stopped a session (None: none now)."""

    session: Any


@dataclass(frozen=True)
class RanksChanged:
    """What the ranks hold changed: a model loaded, a plan applied, a checkpoint loaded, the
    weights quantized or back to full precision."""


@dataclass(frozen=True)
class PlanPicked:
    """A section other than the Plan section applied `plan` (the Which plan? page): the pickers show it."""

    plan: Any


@dataclass(frozen=True)
class StepDone:
    """A training step's records arrived while the job runs."""


@dataclass(frozen=True)
class JobStarted:
    kind: JobKind


@dataclass(frozen=True)
class JobEnded:
    """A job ended, done, failed or stopped (what it finished before a failure or Stop is kept)."""

    kind: JobKind


@dataclass(frozen=True)
class DryRunChanged:
    """The dry-run switch flipped, or a new dry run is kept."""


Event = SessionChosen | RanksChanged | PlanPicked | StepDone | JobStarted | JobEnded | DryRunChanged
Emit = Callable[[Event], None]
