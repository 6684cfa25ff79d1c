"""The model laid out again around a re-formed process group: the rank set's Relayout collaborator.

Owns `ModelState` (what the client knows of the laid-out model: spec, plan, quantization,
debug mode, where the layout's state came from), shared with the model operations
(cluster/model_ops.py), and the choice of where a new group's state comes from: each rank's
kept shards when every rank is the one it was and all hold the same step (a failure inside a
step can leave a rank that finished it beside peers that did not), else the newest snapshot
under the scratch directory, else the seed, with a warning. Handed to the rank set when the
Session is built, so every `require()` may run it. Knows nothing of pools or of why the
group was re-formed.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..plan import ModelSpec, Plan
from ..records import LayoutInfo, RestoreSource
from ..runtime import api
from .scratch import Scratch
from .telemetry import Telemetry

if TYPE_CHECKING:
    from .rankset import RankSet


@dataclass
class ModelState:
    """The client's view of the model on the ranks (one per Session)."""

    spec: ModelSpec | None = None
    plan: Plan | None = None
    quantization: str | None = None
    """The torchao scheme the ranks' model is quantized with (None: full precision)."""
    debug: bool = False
    """TORCH_DISTRIBUTED_DEBUG=DETAIL on the ranks' groups."""
    restored: LayoutInfo | None = None
    """How the last lay-out got its state, and at which step."""


@dataclass
class Recovery:
    """Keeps the survivors' shards before a group is re-formed and lays the model out after it."""

    state: ModelState
    scratch: Scratch
    telemetry: Telemetry
    _kept: list[int | None] = field(default_factory=list)
    """The step each survivor kept its shards at (None: kept nothing trustworthy)."""

    async def keep(self, ranks: "RankSet", which: list[int] | None = None) -> list[int | None]:
        """Each rank (of `which`) keeps its own shards (no copy); the steps they belong to."""
        self._kept = await ranks.call(api.keep_local, ranks=which, what="recover") if which != [] else []
        return self._kept

    def source(self, replaced: bool) -> RestoreSource:
        kept = self._kept
        if not replaced and kept and None not in kept and len(set(kept)) == 1:
            return RestoreSource.KEPT
        return RestoreSource.SNAPSHOT

    async def lay_out(self, ranks: "RankSet", restore: RestoreSource, reload: bool) -> None:
        """The current plan on the new group, its state from `restore` (reload: the ranks build
        the model first, as replacements have none)."""
        st = self.state
        scratch = await self.scratch.shared(ranks) if restore == RestoreSource.SNAPSHOT and self.scratch.created \
            else None
        if reload:
            await ranks.call(api.load_model, (st.spec,), what="load_model")
        st.restored = (await ranks.call(api.apply_plan, (st.plan, scratch, restore), what="apply"))[0]

    # ---- Relayout ---------------------------------------------------------------------------------
    async def before_reform(self, ranks: "RankSet", survivors: list[int]) -> None:
        await self.keep(ranks, survivors)

    async def after_reform(self, ranks: "RankSet", replaced: bool) -> None:
        st = self.state
        if st.spec is None or st.plan is None:
            return
        await self.lay_out(ranks, self.source(replaced), reload=True)
        if st.restored.state == RestoreSource.SEED:
            warnings.warn("no snapshot of the training state survived the failure: the model restarts from its "
                          "seed (snapshots are taken every snapshot_every steps of train)")
        self.telemetry.plan_changed()
        if st.quantization is not None:  # the ranks rebuilt it in full precision
            await ranks.call(api.quantize, (st.quantization,), what="quantize")
