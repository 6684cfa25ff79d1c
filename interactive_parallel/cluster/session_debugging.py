"""The Session's debugging surface: questions about the laid-out model that a researcher asks
while hunting a wrong layout.

Owns the public calls that ask the ranks about their layout without training it. A mixin of
Session, like session_planning.py: stateless, it reads the Session's model operations and rank
set (annotated here, assigned by Session); each remote call is written once as `name_async`, its
blocking twin made by `blocking_twins`. Knows nothing of how a layout is read on a rank.
"""
from __future__ import annotations

from ..records import RecordList
from ..records.lint import LINT_COLUMNS, merged
from ..runtime import api
from .model_ops import ModelOps
from .rankset import RankSet
from .twins import blocking_twins


@blocking_twins
class SessionDebugging:
    """Layout checks on the Session (see the module docstring)."""

    ranks: RankSet
    model: ModelOps

    # ---- the layout lint (runtime/layout/lint.py) ------------------------------------------------
    async def check_layout_async(self) -> RecordList:
        """What the layout lint finds in the applied layout, before any step: a LintFinding per
        parameter (or module), mesh axis and fault: a gradient nothing reduces over an axis its
        inputs vary on, one reduced twice, a partial sum handed on unsummed, a fused q|k|v split
        without its per-head regrouping, a collective that moves a tensor every step where none is
        needed, a sharded dim the axis does not divide; each with a one-line reason and the fix,
        and the ranks whose layout holds it. Those that make the numbers wrong come first
        (severity 'wrong'; apply warns of them), then those that only cost traffic ('cost').
        A static reading of each rank's placements and TP plan: nothing runs, no collective."""
        self.model.require_layout()
        await self.ranks.require()
        per_rank = await self.ranks.call(api.check_layout, what="check_layout")
        return RecordList(merged(f for findings in per_rank for f in findings), columns=LINT_COLUMNS)
