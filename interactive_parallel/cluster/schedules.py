"""The client's schedule preview: a plan checked here, then torch's simulation run in this process.

Owns what Session.preview_schedule does: the plan (given, else the applied one) refused with
validate's messages before torch is imported here, against the loaded model when there is one;
then runtime/client/schedule_preview.py, imported on first use as the dry run is. Runs nothing on the
ranks and knows nothing of how the simulation works.
"""
from __future__ import annotations

from ..plan import ModelSpec, Plan, PlanError, check
from ..records.schedule import SchedulePreview
from .errors import SessionError


def preview_schedule(plan: Plan | None, spec: ModelSpec | None) -> SchedulePreview:
    if plan is None:
        raise SessionError("no plan to preview: pass one (preview_schedule(Plan(pp=2, ...))) or apply one first")
    check(plan, plan.world_size, spec)
    if plan.pp < 2:
        raise PlanError([f"pp({plan.pp}): a pipeline schedule needs pp >= 2"])
    from ..runtime.client.schedule_preview import preview_schedule as simulate

    return simulate(plan)
