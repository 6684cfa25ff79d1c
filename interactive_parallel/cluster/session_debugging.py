"""The Session's debugging surface: why the ranks did what they did.

Owns the public calls that explain a step from what the client already holds: `explain_comms`
(the latest step's collectives grouped by their cause, from the telemetry: no remote call). A
mixin of Session: it reads the Session's telemetry and world size, annotated here and assigned
by Session. Knows nothing of how a cause is read on a rank (runtime/probes/causes.py) nor of
how the tree is grouped (records/comm_tree.py).
"""
from __future__ import annotations

from ..records import RecordList, comm_tree
from .telemetry import Telemetry


class SessionDebugging:
    """Explanations of what the ranks did, on the Session (see the module docstring)."""

    telemetry: Telemetry
    world_size: int

    # ---- why each collective happened (issue 38, item 2) ---------------------------------------------
    def explain_comms(self, steps: int | None = None, rank: int | None = None) -> RecordList:
        """The collectives of the latest step (or the last `steps` steps, summed) as a tree of
        their causes: each module (or wrapper unit), the ops inside it that needed collectives,
        and the collectives each op needed (op, mesh axis, placements before -> after), every
        node with count, bytes and axis, implicit redistributes counted (CommNodes, depth
        first, largest first: records/comm_tree.py). Summed over every rank, or `rank`'s alone.
        A grouping of `comms()`: no remote call, nothing measured again."""
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise ValueError(f"rank {rank!r} is outside this session: ranks are 0..{self.world_size - 1} "
                             f"(world size {self.world_size})")
        return comm_tree(self.telemetry.comms(steps, raw=True), rank=rank)
