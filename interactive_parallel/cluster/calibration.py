"""The client's calibration: the ranks measured at once, their samples fitted to a HardwareProfile.

Owns what Session.calibrate does: refuse (before any rank is touched) a session with no model
(the matmuls are timed at the loaded model's shapes) and options the ranks could not run
(plan.calibration.calibrate_options), then every rank runs runtime.calibration.calibrate at once, each
rank's free memory is read, and plan.calibration.fit_profile fits the profile to the slowest
rank of every sample, on top of a base profile for what calibration does not measure (on a
CPU the shipped 'cpu' profile: its peak and fp16 figures); when the applied plan has a run of
measured steps, a fixed cost per step is taken from them (plan.calibration.anchor_step_overhead).
Knows nothing of how a sample is taken or a line is fitted; never imports torch. The Planner
keeps the calibrated profile for the session's predictions (plan.steptime) and plan searches
(plan.search), which run here, pure.
"""
from __future__ import annotations

import statistics
from typing import Iterable, Sequence

from ..plan import ModelSpec, Plan
from ..plan.calibration import anchor_step_overhead, calibrate_options, fit_profile
from ..plan.hardware import get_profile
from ..records import RecordList
from ..records.hardware import HardwareProfile, StepPrediction
from ..runtime import api
from .errors import SessionError
from .rankset import RankSet

ANCHOR_STEPS = 3
"""Measured steps of the applied plan (after its first) that Session.calibrate takes the
fixed cost per step from (a replicated wrapper's, or the runtime loop's); fewer: the bare model
step's estimate stands."""


async def calibrate(ranks: RankSet, spec: ModelSpec | None, plan: Plan | None, *,
                    precisions: Iterable[str] | None = None, repeats: int = 5,
                    base: str | HardwareProfile | None = None) -> HardwareProfile:
    """The profile of these ranks, measured at `spec`'s shapes and the micro-step tokens of
    `plan` (None: the default plan's); `base` (a shipped profile's name or a profile; None: 'cpu'
    on a CPU, none on GPUs) gives what calibration does not measure."""
    if spec is None:
        raise SessionError("no model loaded: calibrate times matmuls at the model's shapes; "
                           "call load_model('tiny-llama') first")
    cuda = ranks.device == "cuda"
    if precisions is None:
        precisions = ("fp32", "bf16", "fp16") if cuda else ("fp32", "bf16")
    options = calibrate_options(spec, ranks.world_size, plan, device=ranks.device, precisions=precisions,
                                repeats=repeats)
    base_profile = get_profile(base) if base is not None else (None if cuda else get_profile("cpu"))
    await ranks.require()
    per_rank = await ranks.call(api.calibrate, (options, spec), what="calibrate")
    memory = await ranks.call(api.host_memory, what="calibrate")
    cores: dict[str, int] = {}
    for place in ranks.places:
        cores[place.host] = max(cores.get(place.host, 0), place.cores)
    return fit_profile([s for samples in per_rank for s in samples], base_profile, host_memory=memory,
                       name=f"calibrated {ranks.world_size} x {ranks.device}", device=ranks.device,
                       cores_per_host=0 if cuda else min(cores.values()), spec=spec, rows=options.rows,
                       seq_len=options.seq_len)


class Planner:
    """The session's step-time questions: the profile its ranks were calibrated to (None until
    Session.calibrate) and the predictions and searches that read it. Knows no ranks beyond the
    one calibration call."""

    def __init__(self) -> None:
        self.calibrated: HardwareProfile | None = None

    def profile(self, profile: str | HardwareProfile | None, device: str) -> HardwareProfile:
        """`profile` by name or as given; None: the calibrated one, else the shipped profile of the
        device ('cpu', or 'h100' for CUDA ranks)."""
        if profile is not None:
            return get_profile(profile)
        return self.calibrated or get_profile("cpu" if device == "cpu" else "h100")

    async def calibrate(self, ranks: RankSet, spec: ModelSpec | None, plan: Plan | None, *,
                        measured: Sequence[float] = (), **kwargs) -> HardwareProfile:
        """The ranks' profile (`calibrate`); with ANCHOR_STEPS or more `measured` step times of
        `plan` (its latest run), a fixed cost per step taken from them."""
        profile = await calibrate(ranks, spec, plan, **kwargs)
        if plan is not None and len(measured) >= ANCHOR_STEPS:
            profile = anchor_step_overhead(profile, spec, plan, statistics.median(measured), len(measured))
        self.calibrated = profile
        return profile

    def predict(self, spec: ModelSpec, plan: Plan, profile: str | HardwareProfile | None, device: str,
                measured: list[float] | None = None) -> StepPrediction:
        from ..plan.steptime import predict_step

        pred = predict_step(spec, plan, self.profile(profile, device))
        if measured:
            pred.measured_s = statistics.median(measured)
        return pred

    def search(self, spec: ModelSpec, world: int, profile: str | HardwareProfile | None, device: str,
               defaults: Plan, **kwargs) -> RecordList:
        from ..plan.search import search_plans

        knobs = {k: kwargs.pop(k, getattr(defaults, k)) for k in ("batch_size", "seq_len")}
        return search_plans(spec, world, self.profile(profile, device), **knobs, **kwargs)
