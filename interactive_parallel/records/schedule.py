"""Records of a pipeline schedule as torch simulates it: one action per rank and time slot.

Owns the simulated action (what a rank does in one slot of torch's simulator: a forward, an
input or weight half of a backward, a full backward, a send or a receive) and the preview of
one plan's schedule (every rank's actions and the idle share the simulation gives each rank).
The measured counterpart is training's PipelineEvent. Knows nothing of torch, ipyparallel or
plotly: runtime/client/schedule_preview.py fills these from torch's simulator, viz/ draws them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from .base import Record

ActionKind = Literal["F", "I", "W", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
"""torch's _ComputationType values: forward, backward of the input (I) and of the weights (W),
full backward (B), and the point-to-point sends and receives of activations (F) and gradients (B)."""
COMPUTE_ACTIONS: tuple[str, ...] = ("F", "I", "W", "B")
COMM_ACTIONS: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class ScheduleAction(Record):
    """One action of one pipeline rank in one slot of torch's schedule simulator."""

    kind: ClassVar[str] = "schedule_action"
    rank: int
    """Pipeline rank (the rank's index in its pp group)."""
    slot: int
    """The simulator's time step; every action, a send or receive too, takes one slot."""
    stage: int
    microbatch: int
    action: ActionKind
    overlapped: bool = False
    """One half of DualPipeV's overlapped forward + backward (torch's OVERLAP_F_B), which the
    simulation runs as its two halves in turn."""

    @property
    def is_compute(self) -> bool:
        return self.action in COMPUTE_ACTIONS


@dataclass
class SchedulePreview(Record):
    """A plan's pipeline schedule as torch's simulator orders it, before any rank runs it."""

    kind: ClassVar[str] = "schedule_preview"
    schedule: str
    """The plan's pp_schedule ('1f1b', 'zbv', ...)."""
    torch_class: str
    """The torch.distributed.pipelining class that runs it ('Schedule1F1B', ...)."""
    pp: int
    microbatches: int
    stages_per_rank: int
    actions: list[ScheduleAction] = field(default_factory=list)
    """Every rank's actions, compute and communication, in (rank, slot) order."""
    slots: int = 0
    """Slots the simulated step takes (the longest rank's)."""
    idle: dict[int, float] = field(default_factory=dict)
    """Pipeline rank -> share of the step's slots in which it waits, its sends and receives left
    out (the simulator gives each a slot as long as a forward's): the simulated bubble, with
    every compute action one slot long (a backward as long as a forward)."""
    notes: list[str] = field(default_factory=list)
    """Where the preview departs from torch's own order, and why."""

    def order(self, rank: int, compute_only: bool = True) -> list[str]:
        """The rank's actions in slot order as torch writes them ('0F1': stage 0, forward, microbatch 1)."""
        return [f"{a.stage}{a.action}{a.microbatch}" for a in self.actions
                if a.rank == rank and (a.is_compute or not compute_only)]
