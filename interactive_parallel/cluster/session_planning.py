"""The Session's planning surface: what a plan would cost, checked here before any rank runs it.

Owns the public calls that answer questions about a plan from this client: predicted memory and
communication (plan/estimate), a dry run of the loaded model on any number of virtual ranks
(runtime.client.dryrun, in this process), torch's simulated pipeline schedule
(cluster/schedules.py), and the step-time model: calibrating the ranks to a HardwareProfile (the
one call here that runs on them, a coroutine with its blocking twin), predicting a plan's step
on it and searching every layout for the fastest that fits. A mixin of Session: it reads the
Session's model operations, telemetry, planner and rank set, annotated here and assigned by
Session. Knows nothing of how estimates, simulations or fits are made.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..plan import Plan
from ..plan.virtual import DryRun
from ..records import RecordList
from ..records.hardware import HardwareProfile, StepPrediction
from ..records.schedule import SchedulePreview
from .calibration import Planner
from .model_ops import ModelOps
from .rankset import RankSet
from .schedules import preview_schedule
from .telemetry import MEMORY_COLUMNS, Telemetry
from .twins import blocking_twins


@blocking_twins
class SessionPlanning:
    """Predictions, dry runs, schedule previews and calibration, on the Session (see the module docstring)."""

    ranks: RankSet
    telemetry: Telemetry
    model: ModelOps
    planner: Planner

    def predict_memory(self, plan: Plan | None = None) -> RecordList:
        """Predicted MemoryRecords per rank (step -1) for `plan` (default: the current one);
        needs no rank to have run it."""
        from ..plan.estimate import predict_memory

        spec = self.model.require_model()
        return RecordList(predict_memory(spec, plan or self.plan or self.model.default_plan()),
                          columns=MEMORY_COLUMNS[:-1])

    def predict_comms(self, plan: Plan | None = None) -> RecordList:
        """Predicted bytes per step per (op, mesh axis) on rank 0 (plan/estimate)."""
        from ..plan.estimate import predict_comms

        spec = self.model.require_model()
        return RecordList(predict_comms(spec, plan or self.plan or self.model.default_plan()))

    def dry_run(self, plan: Plan | None = None, world: int | None = None, **kwargs: Any) -> DryRun:
        """The loaded model laid out under `plan` (default: the current one) over `world` virtual
        ranks (default: the plan's, which may exceed this session's), in this process on fake
        tensors: a DryRun with the records a live session of that size would hold (memory(),
        comms(), layout()). Touches no rank; loads torch here on first use."""
        from ..plan import check

        spec, plan = self.model.require_model(), plan or self.plan or self.model.default_plan()
        check(plan, plan.world_size if world is None else world, spec)  # before torch loads here
        from ..runtime.client.dryrun import dry_run

        return dry_run(spec, plan, world, **kwargs)

    def preview_schedule(self, plan: Plan | None = None) -> SchedulePreview:
        """torch's simulated order of `plan`'s pipeline schedule (default: the applied plan): F / I /
        W / B and sends and receives per pipeline rank and slot, and each rank's simulated idle
        share; viz.schedule_figure draws it beside a measured step. A bad plan is refused with
        validate's messages; runs nothing on the ranks (loads torch here on first use)."""
        return preview_schedule(plan or self.plan, self.spec)

    async def calibrate_async(self, *, precisions: Sequence[str] | None = None, repeats: int = 5) -> HardwareProfile:
        """Measure these ranks as a step uses them, every rank at once: matmuls at the loaded model's
        shapes (tensor-parallel widths too) per precision, elementwise work forward and backward,
        each collective on groups of every size and layout right after a compute burst, and how much
        communication hides behind compute. Returns the HardwareProfile fitted to the slowest rank
        (kept as `calibrated`: predict_step and search_plans read it). Needs a loaded model.
        Train a few steps of the applied plan first (at least ANCHOR_STEPS after the first) and the
        profile's fixed cost per step is taken from them (plan.calibration.anchor_step_overhead):
        under DDP or replicate their wrapper's hooks, else the runtime loop's own."""
        measured = self.telemetry.run_times(self.plan.describe()) if self.plan else []
        return await self.planner.calibrate(self.ranks, self.spec, self.plan, measured=measured,
                                            precisions=precisions, repeats=repeats)

    def predict_step(self, plan: Plan | None = None, profile: str | HardwareProfile | None = None) -> StepPrediction:
        """`plan`'s (default: the applied one) predicted step on `profile` (default: the calibrated
        profile, else the shipped one of the device): seconds split into compute, communication and
        bubble, tokens/s, MFU, peak memory; for the applied plan, the median step time measured so
        far beside it (Telemetry.run_times: its latest run, the first step left out). Pure: touches
        no rank."""
        spec, plan = self.model.require_model(), plan or self.plan or self.model.default_plan()
        measured = self.telemetry.run_times(plan.describe()) if plan == self.plan else []
        return self.planner.predict(spec, plan, profile, self.device, measured)

    def search_plans(self, profile: str | HardwareProfile | None = None, *, memory_per_rank: int | None = None,
                     world: int | None = None, top: int | None = 20, **fixed: Any) -> RecordList:
        """Every valid layout of the loaded model on `world` ranks (default: this session's) that fits
        memory_per_rank bytes (default: the profile's), ranked by predicted tokens/s (plan.search):
        StepPredictions whose plan_fields rebuild each Plan (Plan.from_dict) to apply or dry-run.
        `fixed`: Plan fields held (batch_size and seq_len default to the session's plan's)."""
        spec = self.model.require_model()
        return self.planner.search(spec, world or self.world_size, profile, self.device,
                                   self.plan or self.model.default_plan(), memory_per_rank=memory_per_rank, top=top,
                                   **fixed)
