"""Calibration, rank side, for pipelines and ranks sharing cores: what torch's schedule costs
beyond its stages' work, and how soon a core another rank leaves idle speeds a busy one.

Owns two measurements runtime.calibration.calibrate adds when its options ask for them: steps of torch's
own 1F1B schedule over near-empty stages for every pipeline degree and layout, and bursts of
matmuls timed with every rank busy and with half of them waiting. Knows nothing of the fit
(plan/calibration.py turns them into pipeline_action_s and core_handoff_s) or of models.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ...records.calibration import CalibrateOptions
from ...records.hardware import CalibrationSample
from .measure import Timer, first_ranks_figure, layouts, link_class, my_group


def pipeline_steps(options: CalibrateOptions, timer: Timer, rank: int, world: int, hosts: list,
                   device: torch.device) -> list[CalibrationSample]:
    """Steps of torch's own 1F1B schedule over stages of one 8-wide linear (their compute
    negligible), for every pipeline degree n > 1 dividing the world, on every layout of its
    groups (all pipelines at once, as data-parallel pipelines run) with n and 2 n microbatches:
    what a schedule costs beyond its stages' work (plan.calibration fits a fixed cost per
    action to it through the schedule's replay)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    out = []
    for n in (k for k in range(2, world + 1) if world % k == 0):
        for label, groups in layouts(world, n):
            with my_group(groups, rank) as (mine, pg):
                index = mine.index(rank)
                for m in (n, 2 * n):
                    stage = PipelineStage(torch.nn.Linear(8, 8, device=device), index, n, device, group=pg)
                    schedule = Schedule1F1B(stage, m, loss_fn=lambda y, target: y.sum())
                    x = torch.randn(m, 8, device=device)
                    run = ((lambda s=schedule: s.step(x)) if index == 0 else
                           (lambda s=schedule: s.step(target=x)) if index == n - 1 else (lambda s=schedule: s.step()))
                    seconds = timer.median(run, 2 * options.repeats, dist.barrier)
                    out.append(CalibrationSample(rank=rank, what="pipeline", name=f"1f1b pp{n} m{m} {label}",
                                                 seconds=seconds, size=n, microbatches=m, link=link_class(mine, hosts)))
    return out


HANDOFF_S = (0.002, 0.005, 0.01, 0.02, 0.04)
"""Lengths of the bursts timed for the core handoff, in seconds of every-rank-busy compute."""


def handoff_bursts(options: CalibrateOptions, timer: Timer, rank: int, world: int, device: torch.device,
                   burst: Callable[[], object]) -> list[CalibrationSample]:
    """Bursts of k matmuls timed with every rank computing, and with the second rank of each
    consecutive pair waiting in a recv: where ranks share cores, the lone bursts run faster once
    the scheduler hands them the waiting ranks' cores (plan.calibration fits how soon). Both
    ranks of a pair report the computing rank's time."""
    t_one = timer.per_call(burst, options.repeats, options.batch_s)
    out = []
    flag = torch.zeros(1, device=device)
    with my_group(layouts(world, 2)[0][1], rank) as (mine, pg):
        for target in HANDOFF_S:
            k = torch.tensor([max(1, round(target / max(t_one, 1e-9)))], device=device)
            dist.all_reduce(k, op=dist.ReduceOp.MAX)
            k = int(k.item())
            for alone in (False, True):
                times = []
                for i in range(options.repeats + 1):
                    dist.barrier()
                    if alone and rank != mine[0]:
                        dist.recv(flag, src=mine[0], group=pg)
                        continue
                    t0 = timer.now()
                    for _ in range(k):
                        burst()
                    if i:
                        times.append(timer.now() - t0)
                    if alone:
                        dist.send(flag, dst=mine[1], group=pg)
                busy = world // 2 if alone else world
                out.append(CalibrationSample(rank=rank, what="handoff", name=f"burst x{k} on {busy} ranks",
                                             seconds=first_ranks_figure(times, mine[0], pg, device), size=busy,
                                             microbatches=k))
    return out
