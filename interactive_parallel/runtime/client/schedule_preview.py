"""A plan's pipeline schedule as torch simulates it, without a process group or a model.

Owns the preview: torch.distributed.pipelining's own schedule class for the plan (get_schedule_class)
is built over mock stages, as torch's `_schedule_visualizer.get_schedule_ops` does; its compute
order (`pipeline_order`) is lowered to sends and receives by torch's `_PipelineScheduleRuntime.
_prepare_schedule_with_comms` (`pipeline_order_with_comms`) and stepped through torch's
`schedules._simulate_comms_compute`, which gives every action its slot and every wait its gap.
Needs torch but no ranks: the client imports it lazily (Session.preview_schedule), as the dry
run is. Knows nothing of models, meshes or timing: a slot is one action, whatever it costs, and
a rank's idle share is its waiting slots over the slots it does not spend sending or receiving.

Where torch's pieces do not run as they are, the preview steps in, and says so in `notes`:
- GPipe and 1F1B: their `pipeline_order` carries REDUCE_GRAD, which the lowering refuses in a
  compute-only order; it is dropped (it runs after the last backward and moves nothing).
- 1F1B: torch 2.13's `Schedule1F1B._get_pipeline_order` numbers the last rank's forwards from 1
  (its forward counter is raised before the first use when that rank has no warm-up); the
  schedule's own runtime runs microbatches 0 .. m-1. Each (stage, action) of a rank is numbered
  again in the order it runs (an order that is already right is left as it is).
- DualPipeV: the simulator has no rule for OVERLAP_F_B; each overlapped pair is simulated as its
  two halves in turn (our runtime on CPU runs them so too), marked `overlapped`.
Communication actions other than sends and receives (UNSHARD, RESHARD, REDUCE_GRAD) are left out.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from unittest import mock

from ...plan import Plan, PlanError
from ...plan.validate import check
from ...records.schedule import COMM_ACTIONS, COMPUTE_ACTIONS, ScheduleAction, SchedulePreview

KEPT = COMPUTE_ACTIONS + COMM_ACTIONS


def _schedule(plan: Plan):
    """torch's schedule instance for the plan over mock stages (group rank 0; the order of every
    rank is computed by each rank alike)."""
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.pipelining.stage import PipelineStage

    cls = get_schedule_class(plan.schedule.torch_name)
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, plan.pp, None
    stage.num_stages = plan.n_stages
    single = plan.schedule.placement == "single"
    return cls(stage if single else [stage] * plan.stages_per_rank, plan.n_microbatches), single, stage


def torch_order(plan: Plan) -> dict[int, list]:
    """torch's compute order per pipeline rank (`pipeline_order`, idle entries and REDUCE_GRAD left out)."""
    sched, _, _ = _schedule(plan)
    return {r: [a for a in acts if a is not None and a.is_compute_op] for r, acts in sched.pipeline_order.items()}


def _renumbered(order: dict[int, list], notes: list[str]) -> dict[int, list]:
    """Each (stage, action) of a rank numbered 0, 1, ... in the order it runs, where torch's
    numbers are not 0 .. m-1 (1F1B's last rank)."""
    out = {}
    for rank, acts in order.items():
        seen: Counter = Counter()
        fixed = []
        for a in acts:
            key = (a.stage_index, a.computation_type)
            fixed.append(a._replace(microbatch_index=seen[key]))
            seen[key] += 1
        if fixed != acts:
            notes.append(f"rank {rank}: torch's order numbers its microbatches "
                         f"{[a.microbatch_index for a in acts if a.computation_type.value == 'F']} for its forwards; "
                         "renumbered in the order they run")
        out[rank] = fixed
    return out


def _lowered(plan: Plan, notes: list[str]) -> tuple[dict[int, list], dict[int, int]]:
    """(every rank's order with its sends and receives, stage -> pipeline rank)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    sched, single, stage = _schedule(plan)
    if not single:
        return sched.pipeline_order_with_comms, dict(sched.stage_index_to_group_rank)
    runtime = _PipelineScheduleRuntime([stage], plan.n_microbatches)
    runtime._prepare_schedule_with_comms(_renumbered(torch_order(plan), notes))
    return runtime.pipeline_order_with_comms, dict(runtime.stage_index_to_group_rank)


def _halves(order: dict[int, list]) -> tuple[dict[int, list], set]:
    """The order with each OVERLAP_F_B as its sub-actions in turn; the set of those halves."""
    out, halves = {}, set()
    for rank, acts in order.items():
        flat = []
        for a in acts:
            if a.computation_type.value == "OVERLAP_F_B":
                flat += list(a.sub_actions or ())
                halves.update(a.sub_actions or ())
            elif a.computation_type.value in KEPT:
                flat.append(a)
        out[rank] = flat
    return out, halves


def preview_schedule(plan: Plan) -> SchedulePreview:
    """The plan's schedule as torch simulates it (plan.check first: pp > 1 and the schedule's
    microbatch constraints)."""
    from torch.distributed.pipelining.schedules import _simulate_comms_compute

    check(plan, plan.world_size)
    if plan.pp < 2:
        raise PlanError([f"pp({plan.pp}): a pipeline schedule needs pp >= 2"])
    notes: list[str] = []
    lowered, owner = _lowered(plan, notes)
    flat, halves = _halves(lowered)
    if halves:
        notes.append("OVERLAP_F_B (DualPipeV's forward beside a backward) simulated as its two halves in turn")
    simulated = _simulate_comms_compute(flat, lambda s: owner[s], plan.n_stages)
    actions, busy, comm = [], defaultdict(int), defaultdict(int)
    slots = max((len(v) for v in simulated.values()), default=0)
    for rank in sorted(simulated):
        for slot, a in enumerate(simulated[rank]):
            if a is None:
                continue
            kind = a.computation_type.value
            actions.append(ScheduleAction(rank=rank, slot=slot, stage=a.stage_index, microbatch=a.microbatch_index,
                                          action=kind, overlapped=a in halves))
            busy[rank] += kind in COMPUTE_ACTIONS
            comm[rank] += kind in COMM_ACTIONS
    # A send or receive takes a slot in the simulator, as long as a forward: counted as a wait it
    # would swamp the bubble, so a rank's idle share is its waiting slots over those it does not communicate in.
    idle = {r: 1.0 - busy[r] / (slots - comm[r]) if slots > comm[r] else 0.0 for r in sorted(simulated)}
    return SchedulePreview(schedule=plan.pp_schedule, torch_class=plan.schedule.torch_class,
                           pp=plan.pp, microbatches=plan.n_microbatches, stages_per_rank=plan.stages_per_rank,
                           actions=actions, slots=slots, idle=idle, notes=notes)
