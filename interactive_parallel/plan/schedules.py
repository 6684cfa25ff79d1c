"""The pipeline schedules a plan may name, one record each: every fact about a schedule decided once.

Owns `PipelineSchedule` (our name, torch's name, how its stages sit on the pipeline ranks, whether
it splits a backward into input and weight halves, its microbatch rule, the builder of its order
in plan.pipeline_order), SCHEDULES (our name -> record, in the order the panel and the search
offer them) and the torch schedules not offered, each with its reason (REFUSED_TORCH_SCHEDULES).
Plan (its stages, `zero_bubble`, `pipeline_ops`), plan.validate, the estimator and the step-time
model, the schedule preview, runtime.parallel.pp and the panel (through the Plan field's choices)
read these records; none tests a schedule's name. Adding a schedule: its order builder in
plan.pipeline_order and one record here. Pure Python: knows no torch (tests/test_schedules.py
holds each record to torch's class) and nothing of the Plan, which reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from . import pipeline_order as order
from .pipeline_order import Op, OrderBuilder

Placement = Literal["single", "looped", "v"]
"""How a schedule's stages sit on the pipeline ranks: one each ('single', torch's
PipelineScheduleSingle); `virtual_stages` each, looped (rank r holds stages r, r + pp, ...); two
each, laid out as a V (rank r holds stages r and 2 * pp - 1 - r: the first and last on rank 0)."""
MicrobatchRule = Literal["any", "at_least_pp", "rounds_of_pp", "at_least_stages"]
"""What a schedule asks of the microbatch count m at pp ranks, as torch's class checks it (later,
on the ranks): nothing; m >= pp; the looped ones' rounds of up to pp, max(1, m // pp) of them,
dividing m (pp 2: 1, 2, 3, 4, 6 run, 5 does not); a microbatch per stage, m >= 2 * pp."""


@dataclass(frozen=True)
class PipelineSchedule:
    """One pipeline schedule: what validate, the estimator, the preview and the runtime know of it."""

    name: str
    """Our name, as Plan.pp_schedule holds it ('1f1b')."""
    torch_name: str
    """torch.distributed.pipelining's name for get_schedule_class ('1F1B'); Plan accepts it too."""
    placement: Placement
    zero_bubble: bool
    """Whether it splits a backward into its input half (B) and its weight half (W), run later."""
    microbatches: MicrobatchRule
    order: OrderBuilder
    """The builder of one rank's order in plan.pipeline_order."""
    min_virtual_stages: int = 1
    """Looped only: the fewest stages per rank offered. Interleaved1F1B: 2, refused here since the
    first version though torch's class builds it over one; InterleavedZeroBubble also runs with
    one (measured)."""
    about: str = ""

    @property
    def torch_class(self) -> str:
        """The class get_schedule_class returns ('Schedule1F1B')."""
        return f"Schedule{self.torch_name}"

    @property
    def looped(self) -> bool:
        return self.placement == "looped"

    @property
    def v_shaped(self) -> bool:
        return self.placement == "v"

    def stages_per_rank(self, virtual_stages: int) -> int:
        return {"single": 1, "looped": virtual_stages, "v": 2}[self.placement]

    def stage_ids(self, pp: int, pp_rank: int, virtual_stages: int) -> list[int]:
        """Global stages held by pipeline rank `pp_rank`, in the order it builds them."""
        if self.v_shaped:
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return list(range(pp_rank, pp * self.stages_per_rank(virtual_stages), pp))

    def stage_owner(self, pp: int, stage: int) -> int:
        """The pipeline rank holding global stage `stage` (stage_ids' inverse)."""
        if self.v_shaped:
            return stage if stage < pp else 2 * pp - 1 - stage
        return stage % pp

    def ops(self, pp: int, pp_rank: int, microbatches: int, virtual_stages: int) -> list[Op]:
        """(action, local stage, split) in the order pipeline rank `pp_rank` runs them in one step."""
        return self.order(pp, pp_rank, microbatches, virtual_stages)

    def problems(self, pp: int, m: int, virtual_stages: int) -> list[str]:
        """What this schedule refuses at pp ranks and m microbatches (plan.validate's words)."""
        if self.looped and self.min_virtual_stages > 1 and virtual_stages < self.min_virtual_stages:
            return [f"pp_schedule {self.name!r} needs virtual_stages({virtual_stages}) >= {self.min_virtual_stages}"]
        if self.microbatches == "at_least_pp" and m < pp:
            return [f"pp_schedule {self.name!r} needs microbatches({m}) >= pp({pp})"]
        if self.microbatches == "rounds_of_pp" and m % max(1, m // pp):
            return [f"pp_schedule {self.name!r} needs microbatches({m}) to be a multiple of its rounds "
                    f"max(1, microbatches({m}) // pp({pp})) = {max(1, m // pp)}"]
        if self.microbatches == "at_least_stages" and m < 2 * pp:
            return [f"pp_schedule {self.name!r} needs microbatches({m}) >= stages(2 * pp({pp}) = {2 * pp})"]
        return []


_ALL = (
    PipelineSchedule("gpipe", "GPipe", "single", False, "any", order.gpipe,
                     about="every forward, then every backward"),
    PipelineSchedule("1f1b", "1F1B", "single", False, "at_least_pp", order.one_f_one_b,
                     about="a warm-up of forwards, then one forward and one backward in turn"),
    PipelineSchedule("interleaved-1f1b", "Interleaved1F1B", "looped", False, "rounds_of_pp",
                     order.interleaved_1f1b, min_virtual_stages=2,
                     about="1F1B over virtual_stages stages per rank, looped"),
    PipelineSchedule("interleaved-zb", "InterleavedZeroBubble", "looped", True, "rounds_of_pp",
                     order.interleaved_zb, about="interleaved 1F1B, each backward split in its two halves"),
    # ZBVZeroBubble has no microbatch rule: its order is built for max(m, 2 * pp - 1) microbatches
    # and the missing ones left out (m = 1 at pp 2 and m = 4 at pp 4 ran at parity, measured).
    PipelineSchedule("zbv", "ZBVZeroBubble", "v", True, "any", order.zbv,
                     about="zero bubble over two stages per rank laid out as a V"),
    PipelineSchedule("dualpipev", "DualPipeV", "v", True, "at_least_stages", order.dualpipev,
                     about="DeepSeek's DualPipe on a V: a forward overlapped with a backward"),
)
SCHEDULES: dict[str, PipelineSchedule] = {s.name: s for s in _ALL}
"""Our name -> its record, in the order they are offered."""
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)
REFUSED_TORCH_SCHEDULES: dict[str, str] = {
    "LoopedBFS": "not offered: its breadth-first order has no builder in plan.pipeline_order, and it was "
                 "never run at parity here",
    "PipelineScheduleSingle": "a base class, not a schedule",
    "PipelineScheduleMulti": "a base class, not a schedule",
}
"""get_schedule_class names with no record here, and why."""


def schedule_named(name: str) -> PipelineSchedule | None:
    """The record for our name or torch's (any case); None for a name neither spells."""
    if name in SCHEDULES:
        return SCHEDULES[name]
    return next((s for s in _ALL if s.torch_name.lower() == name.lower()), None)


def unknown_schedule(name: str) -> str:
    """plan.validate's words for a pp_schedule no record has."""
    return (f"pp_schedule {name!r} is not one of {', '.join(SCHEDULES)} "
            f"(or torch's {', '.join(s.torch_name for s in _ALL)})")
