"""The plan search: every valid layout of a model on a number of ranks, ranked by predicted speed.

Owns the enumeration (degrees over every axis of the Plan: dp, fsdp, tp, pp, cp and, for a
mixture of experts, ep; then for the fastest layouts every pipeline schedule, microbatch
count, recomputation mode, precision, loss parallel and context-parallel method), the
memory filter (plan.estimate's bytes per rank against the budget, exactly the dry run's), and
the refusal when nothing fits (naming the plan that came closest and by how much). Times are
plan.steptime's. Two passes keep a thousand ranks within seconds: each layout is first timed
with default knobs (1F1B, one microbatch per stage, no recomputation), then the `refine`
fastest layouts are tried under every knob and each keeps its fastest variant that fits.
Sequence parallel is always on under tp (no slower in this model, never more memory).
Pure Python: knows no torch.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from ..records import HardwareProfile, RecordList, StepPrediction
from .hardware import get_profile
from .models import ModelSpec, resolve_model
from .plan import PP_SCHEDULES, RECOMPUTES, Plan, PlanError
from .steptime import predict_step
from .validate import validate

SEARCH_COLUMNS = ("plan", "schedule", "microbatches", "recompute", "grad_accum", "precision", "seconds", "compute_s",
                  "comm_s", "bubble_s", "tokens_per_s", "mfu", "memory_bytes")
MEMORY_CHECKS = 6
"""Knob variants of a refined layout whose memory is predicted, fastest first, before it keeps its row."""
KNOB_FIELDS = ("grad_accum", "pp_schedule", "microbatches", "recompute", "precision", "loss_parallel", "cp_method", "virtual_stages")


class NoPlanFits(PlanError):
    """No valid layout fits the memory budget; `closest` is the one that came nearest."""

    def __init__(self, problems: list[str], closest: StepPrediction | None = None):
        super().__init__(problems)
        self.closest = closest


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(spec: ModelSpec, ranks: int, batch_size: int, seq_len: int, fixed: dict[str, Any]) -> Iterator[dict]:
    """Degree combinations whose product is `ranks` and that the model, batch and sequence allow
    (the finer rules are validate's): each as Plan keyword arguments."""
    kv = spec.num_kv_heads
    for tp in _divisors(ranks):
        if kv % tp and spec.num_heads % tp:
            continue
        for pp in _divisors(ranks // tp):
            if pp > spec.num_layers:
                continue
            for cp in _divisors(ranks // tp // pp):
                if cp > 1 and (pp > 1 or seq_len % (2 * cp)):
                    continue
                data = ranks // tp // pp // cp
                for fsdp in _divisors(data):
                    dp = data // fsdp
                    if batch_size % (dp * fsdp):
                        continue
                    for ep in _expert_degrees(spec, dp * fsdp * cp):
                        kw = dict(dp=dp, fsdp=fsdp, tp=tp, pp=pp, cp=cp, ep=ep)
                        if all(kw.get(k, v) == v for k, v in fixed.items() if k in kw):
                            yield kw


def _expert_degrees(spec: ModelSpec, data_ranks: int) -> list[int]:
    if spec.family_info.experts is None or not spec.num_experts:
        return [1]
    return [e for e in _divisors(data_ranks) if spec.num_experts % e == 0]


def _knobs(base: Plan, precisions: tuple[str, ...], fixed: dict[str, Any]) -> Iterator[dict]:
    """Every schedule x microbatches x recompute x precision x loss parallel x cp method for `base`
    (its grad_accum kept)."""
    local = base.batch_size // base.data_parallel // base.grad_accum
    schedules = PP_SCHEDULES if base.pp > 1 else ("1f1b",)
    micro = sorted({m for m in (base.pp, 2 * base.pp, 4 * base.pp) if local % m == 0}) if base.pp > 1 else [0]
    for schedule in schedules:
        for m in micro:
            for recompute in RECOMPUTES:
                for precision in precisions:
                    for lp in ((False, True) if base.tp > 1 else (False,)):
                        for method in (("allgather", "ring") if base.cp > 1 else ("allgather",)):
                            kw = dict(pp_schedule=schedule, microbatches=m, recompute=recompute, precision=precision,
                                      loss_parallel=lp, cp_method=method)
                            if all(kw.get(k, v) == v for k, v in fixed.items() if k in kw):
                                yield kw


def _ladder(base: Plan, fixed: dict[str, Any]) -> Iterator[dict]:
    """What trades time for memory on a layout: recomputation, and accumulation (fewer rows per
    micro-step), each micro-step keeping at least one microbatch per stage; the leanest last."""
    local = base.batch_size // base.data_parallel
    for accum in [a for a in (1, 2, 4, 8, 16, 32, 64) if local % (a * max(1, base.pp)) == 0] or [1]:
        for recompute in RECOMPUTES:
            kw = dict(grad_accum=accum, recompute=recompute)
            if all(kw.get(k, v) == v for k, v in fixed.items() if k in kw):
                yield kw


def _precisions(profile: HardwareProfile, device: str, fixed: dict[str, Any]) -> tuple[str, ...]:
    if "precision" in fixed:
        return (fixed["precision"],)
    # On GPUs bf16 runs at fp16's rate with no scaler, and fp32 is slower with more memory: both are
    # dominated. On a CPU autocast's bf16 is slower than fp32 but saves memory: both are tried.
    return ("bf16",) if device == "cuda" else ("fp32", "bf16")


def search_plans(model: Any, ranks: int, profile: str | HardwareProfile = "cpu", *, memory_per_rank: int | None = None,
                 batch_size: int = 8, seq_len: int = 64, top: int | None = None, refine: int = 12,
                 **fixed: Any) -> RecordList:
    """Every valid layout of `model` on `ranks` ranks that fits `memory_per_rank` bytes (default: the
    profile's memory per device), ranked by predicted tokens/s: one StepPrediction per layout (its
    fastest variant that fits), with the split of its step, MFU and peak memory. `fixed`: Plan fields
    held (e.g. tp=8, recompute='full', precision='bf16'). Raises NoPlanFits naming the closest plan."""
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    prof = get_profile(profile)
    budget = memory_per_rank or prof.memory_bytes
    unknown = [k for k in fixed if k not in {f.name for f in dataclasses.fields(Plan)}]
    if unknown:
        raise ValueError(f"search_plans: {', '.join(unknown)} is not a Plan field")
    if ranks < 1:
        raise ValueError(f"search_plans: ranks({ranks}) must be >= 1")
    device = fixed.pop("device", prof.device)
    plain = {k: v for k, v in fixed.items() if k not in KNOB_FIELDS and k not in ("dp", "fsdp", "tp", "pp", "cp", "ep")}
    precisions = _precisions(prof, device, fixed)
    rows, closest = [], None

    def consider(row: StepPrediction | None, near: StepPrediction | None) -> None:
        nonlocal closest
        if row is not None:
            rows.append(row)
        elif near is not None and (closest is None or near.memory_bytes < closest.memory_bytes):
            closest = near

    bases = []
    for kw in layouts(spec, ranks, batch_size, seq_len, fixed):
        base = Plan(device=device, batch_size=batch_size, seq_len=seq_len, sequence_parallel=kw["tp"] > 1,
                    precision=precisions[0], **kw, **plain)
        if not validate(base, ranks, spec):
            bases.append(base)
    if not bases:
        raise PlanError([f"no valid layout of {spec.name} on {ranks} ranks at batch_size({batch_size}), "
                         f"seq_len({seq_len})" + (f" with {fixed}" if fixed else "")])
    firsts = []
    for base in bases:
        row, near = _lightest_fitting(spec, base, prof, budget, ranks, fixed)
        if row is None:
            consider(None, near)
        else:
            firsts.append(row)
    firsts.sort(key=lambda p: -p.tokens_per_s)
    for i, row in enumerate(firsts):
        if i >= refine:
            rows.append(row)
            continue
        base = Plan.from_dict(row.plan_fields)
        best, _ = _fastest_fitting(spec, base, prof, budget, ranks, list(_knobs(base, precisions, fixed)))
        rows.append(best if best is not None and best.seconds < row.seconds else row)
    if not rows:
        raise NoPlanFits([_closest_line(spec, ranks, budget, closest)], closest)
    rows.sort(key=lambda p: -p.tokens_per_s)
    return RecordList(rows[:top] if top else rows, columns=SEARCH_COLUMNS)


def _fastest_fitting(spec: ModelSpec, base: Plan, prof: HardwareProfile, budget: int, ranks: int,
                     variants: list[dict]) -> tuple[StepPrediction | None, StepPrediction | None]:
    """(the fastest variant of `base` that fits, else None; the variant with the least memory),
    memory predicted in order of time until one fits (at most MEMORY_CHECKS, then the leanest)."""
    timed = []
    for kw in variants:
        plan = base.replace(**kw) if kw else base
        if kw and validate(plan, ranks, spec):
            continue
        timed.append((predict_step(spec, plan, prof, memory=False).seconds, plan))
    timed.sort(key=lambda x: x[0])
    near = None
    for _, plan in timed[:MEMORY_CHECKS]:
        pred = predict_step(spec, plan, prof, memory_per_rank=budget)
        if pred.fits:
            return pred, None
        if near is None or pred.memory_bytes < near.memory_bytes:
            near = pred
    return None, near


def _lightest_fitting(spec: ModelSpec, base: Plan, prof: HardwareProfile, budget: int, ranks: int,
                      fixed: dict[str, Any]) -> tuple[StepPrediction | None, StepPrediction | None]:
    """The fastest (grad_accum, recompute) of `base` that fits, else (None, the leanest tried).

    Memory falls as recomputation and accumulation grow and time rises with them: per
    accumulation, from the least recomputation up, the first that fits; accumulation grows
    while its fastest variant could still beat the best found."""
    best = near = None
    accums = sorted({kw["grad_accum"] for kw in _ladder(base, fixed)})
    for accum in accums:
        modes = [kw["recompute"] for kw in _ladder(base, fixed) if kw["grad_accum"] == accum]
        plans = [base.replace(grad_accum=accum, recompute=m) for m in modes]
        plans = [p for p in plans if not validate(p, ranks, spec)]
        if not plans:
            continue
        if best is not None and predict_step(spec, plans[0], prof, memory=False).seconds >= best.seconds:
            break
        lean = predict_step(spec, plans[-1], prof, memory_per_rank=budget)
        if not lean.fits:
            near = lean if near is None or lean.memory_bytes < near.memory_bytes else near
            continue
        for plan in plans[:-1]:
            pred = predict_step(spec, plan, prof, memory_per_rank=budget)
            if pred.fits:
                lean = pred
                break
        if best is None or lean.seconds < best.seconds:
            best = lean
    return best, (None if best is not None else near)


def _closest_line(spec: ModelSpec, ranks: int, budget: int, closest: StepPrediction | None) -> str:
    gib = 2**30
    if closest is None:
        return f"no layout of {spec.name} on {ranks} ranks fits {budget / gib:,.2f} GiB per rank"
    over = closest.memory_bytes - budget
    return (f"no layout of {spec.name} on {ranks} ranks fits {budget / gib:,.2f} GiB per rank: the closest, "
            f"{closest.plan}, needs {closest.memory_bytes / gib:,.2f} GiB on its fullest rank "
            f"({over / gib:,.2f} GiB, {over / budget:.0%} over)")
