"""Calibration, pure side: what to measure for a model, and a HardwareProfile fitted to it.

Owns `calibrate_options` (the matmul shapes of a model's linears at tensor-parallel local
widths, the token counts of a micro-step, the compute burst, checked before any rank is
touched) and `fit_profile`: per sample the slowest rank (a step waits for it), then weighted
least squares of t = a + x / rate for matmuls (x = FLOPs), elementwise ops (x = bytes) and
each collective per (op, group size, link class) (x = bytes times the op's bus factor). The
weights are 1 / t^2, so every size counts by its relative error and the small sizes fix the
fixed costs while the large ones fix the rates. Knows nothing of torch or of how the samples
were taken (runtime/calibration/calibrate.py takes them).
"""
from __future__ import annotations

import dataclasses
import statistics
from datetime import datetime, timezone
from typing import Iterable, Sequence

from ..records import HostMemory
from ..records.calibration import (COLLECTIVE_OPS, OVERLAP_BOTH, OVERLAP_COLLECTIVE, OVERLAP_MATMUL, OVERLAP_OPS,
                                   CalibrateOptions)
from ..records.hardware import CalibrationSample, HardwareProfile, Link
from .models import ModelSpec
from .plan import Plan

TP_SPLITS = (1, 2, 4)
"""Tensor-parallel degrees whose local widths are timed (where they divide the world and the width)."""
PRECISIONS = ("fp32", "bf16", "fp16")


class CalibrationError(ValueError):
    """Options or samples a calibration cannot use; the message names what is wrong or missing."""


def linear_shapes(spec: ModelSpec, world_size: int) -> tuple[tuple[int, int], ...]:
    """(in, out) of a block's linears (h->q, h->kv, q->h, h->I, I->h) and the head (h->V), each
    at the local width of tp = 1, 2, 4 where tp divides the world and what it splits (heads,
    kv heads, the intermediate size, the vocabulary): column-parallel linears split their
    output, row-parallel ones their input."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    linears = (  # (in, out, split side, what must divide)
        (h, q, "out", spec.num_heads), (h, kv, "out", spec.num_kv_heads), (q, h, "in", spec.num_heads),
        (h, spec.intermediate_size, "out", spec.intermediate_size), (spec.intermediate_size, h, "in",
                                                                     spec.intermediate_size),
        (h, spec.vocab_size, "out", spec.vocab_size))
    shapes: list[tuple[int, int]] = []
    for fan_in, fan_out, side, unit in linears:
        for tp in TP_SPLITS:
            if world_size % tp or unit % tp:
                continue
            shape = (fan_in, fan_out // tp) if side == "out" else (fan_in // tp, fan_out)
            if shape not in shapes:
                shapes.append(shape)
    return tuple(shapes)


def micro_tokens(plan: Plan, world_size: int) -> tuple[int, ...]:
    """Rows of one micro-step's matmuls on one rank: the plan's tokens per micro-step split over
    every rank (all data-parallel) and over none (all tensor-parallel), and the plan's own."""
    total = max(plan.batch_size * plan.seq_len // max(plan.grad_accum, 1), 1)
    own = max(total // max(plan.data_parallel * plan.cp * plan.n_microbatches, 1), 1)
    return tuple(sorted({max(total // world_size, 1), own, total}))


def calibrate_options(spec: ModelSpec, world_size: int, plan: Plan | None = None, *, device: str = "cpu",
                      precisions: Iterable[str] | None = None, repeats: int = 5,
                      all_to_all: bool = False) -> CalibrateOptions:
    """What the ranks measure for `spec` on `world_size` ranks (`plan`: the applied one, else
    the default training knobs); refused (CalibrationError, every reason) before any rank is touched."""
    plan = plan or Plan(dp=world_size, device=device)
    chosen = tuple(precisions) if precisions is not None else ("fp32", "bf16")
    problems = [f"precision {p!r} is not one of {list(PRECISIONS)}" for p in chosen if p not in PRECISIONS]
    if "fp16" in chosen and device != "cuda":
        problems.append("precision 'fp16' is CUDA only (plans refuse it on a CPU too)")
    if not chosen:
        problems.append("no precision to calibrate")
    tokens = micro_tokens(plan, world_size)
    ops = ("all_reduce", "all_gather", "reduce_scatter", "send") + (("all_to_all",) if all_to_all else ())
    rows = max(plan.batch_size // max(plan.data_parallel * plan.grad_accum, 1), 1)
    rows = max(rows // plan.n_microbatches, 1) if plan.pp > 1 else rows
    options = CalibrateOptions(shapes=linear_shapes(spec, world_size), tokens=tokens,
                               burst=(max(tokens), spec.hidden_size, spec.intermediate_size),
                               precisions=chosen, ops=ops, repeats=repeats, rows=rows, seq_len=plan.seq_len)
    problems += options.problems(world_size)
    if world_size < 2:
        problems.append(f"ranks({world_size}): collectives need at least 2 ranks")
    if problems:
        raise CalibrationError("cannot calibrate: " + "; ".join(problems))
    return options


def bus_factor(op: str, n: int) -> float:
    """Bytes through each rank's link per byte of the full buffer (nccl-tests' bus bandwidth)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("send", "recv"):
        return 1.0
    return (n - 1) / n


def slowest(samples: Sequence[CalibrationSample]) -> list[CalibrationSample]:
    """Per measurement (kind and name) the sample of the rank that took longest; every
    measurement must come from every rank that sent samples."""
    ranks = sorted({s.rank for s in samples})
    by_key: dict[tuple[str, str], dict[int, CalibrationSample]] = {}
    for s in samples:
        by_key.setdefault((s.what, s.name), {})[s.rank] = s
    short = [f"{name!r} lacks rank(s) {sorted(set(ranks) - set(got))}" for (_, name), got in by_key.items()
             if len(got) < len(ranks)]
    if short:
        raise CalibrationError("incomplete calibration: " + "; ".join(short[:5]) +
                               (f"; and {len(short) - 5} more" if len(short) > 5 else ""))
    return [max(got.values(), key=lambda s: s.seconds) for got in by_key.values()]


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(a, rate) of t = a + x / rate over (x, t) points, weighted by 1 / t^2; a >= 0 and
    rate > 0 (refitted through the origin when the intercept comes out negative, and the
    throughput of the whole when the slope does not come out positive)."""
    pts = [(float(x), float(t)) for x, t in points if t > 0]
    if not pts:
        raise CalibrationError("no positive times to fit")
    ws = [1.0 / (t * t) for _, t in pts]
    sw = sum(ws)
    mx = sum(w * x for w, (x, _) in zip(ws, pts)) / sw
    mt = sum(w * t for w, (_, t) in zip(ws, pts)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, (x, _) in zip(ws, pts))
    slope = sum(w * (x - mx) * (t - mt) for w, (x, t) in zip(ws, pts)) / sxx if sxx > 0 else 0.0
    a = mt - slope * mx
    if slope > 0 and a >= 0:
        return a, 1.0 / slope
    if slope > 0:  # a negative fixed cost is noise at the small sizes: the line through the origin
        return 0.0, sum(w * x * x for w, (x, _) in zip(ws, pts)) / sum(w * x * t for w, (x, t) in zip(ws, pts))
    # Not growing with x over the sizes measured (noise, or all latency): the smallest time as the
    # fixed cost, the largest size's throughput as the rate (an upper bound on what x costs).
    x_max, t_at = max(pts)
    return min(t for _, t in pts), x_max / t_at if x_max > 0 else 1.0


def fit_profile(samples: Sequence[CalibrationSample], base: HardwareProfile | None = None, *,
                name: str | None = None, host_memory: Sequence[HostMemory] = (), device: str | None = None,
                cores_per_host: int | None = None, spec: ModelSpec | None = None, rows: int = 0,
                seq_len: int = 0) -> HardwareProfile:
    """The profile the samples measure (their slowest rank's), on top of `base` (None: none):
    flops per precision, op and matmul overheads, memory bandwidth, one link per (link class,
    op, group size) plus each class's '*' link, and overlap are fitted; peak_flops come from
    `base` (else the fitted rates), as do the rates of precisions not measured (fp16 on a
    CPU) and the links of (class, op, size) not measured; memory_bytes and devices_per_host
    from `host_memory` (each rank's host: its available bytes over the ranks it holds, or the
    GPU's free bytes), else from `base`. `device` and `cores_per_host` (the cores a host's
    ranks share; 0 for GPUs) default to the base's. With `spec` and its model steps among the
    samples (`rows` x `seq_len` each), op_overhead_s and step_overhead_s come from those steps
    (what a real block costs per operation, not a chain of adds); with pipeline steps and handoff
    bursts among them, pipeline_action_s and core_handoff_s (else the base's)."""
    if not samples:
        raise CalibrationError("no calibration samples: nothing to fit (did calibrate run on the ranks?)")
    top = slowest(samples)
    mm = [s for s in top if s.what == "matmul"]
    ops = [s for s in top if s.what == "op"]
    coll = [s for s in top if s.what == "collective" and s.op not in OVERLAP_OPS]
    missing = [what for what, got in (("matmul", mm), ("op (elementwise)", ops), ("collective", coll)) if not got]
    if missing:
        raise CalibrationError(f"incomplete calibration: no {' / '.join(missing)} samples among {len(samples)}")
    op_overhead, bandwidth = fit_line([(s.bytes, s.seconds) for s in ops])
    flops, intercepts = {}, {}
    for precision in sorted({s.precision for s in mm}):
        intercepts[precision], flops[precision] = fit_line([(s.flops, s.seconds) for s in mm
                                                            if s.precision == precision])
    mm_fixed = intercepts.get("fp32", min(intercepts.values()))
    steps = {s.size: s.seconds for s in top if s.what == "step"}
    links = _fit_links(coll)
    measured = {(x.link, x.op, x.size) for x in links}
    kept = [x for x in (base.links if base else []) if (x.link, x.op, x.size) not in measured]
    ranks = sorted({s.rank for s in samples})
    memory, per_host, hosts = _memory(host_memory, base, coll, len(ranks))
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fitted = HardwareProfile(
        name=name or (f"{base.name} (calibrated)" if base else "calibrated"),
        flops={**(base.flops if base else {}), **flops},
        peak_flops={**flops, **base.peak_flops} if base else dict(flops), memory_bytes=memory,
        memory_bandwidth=bandwidth, devices_per_host=per_host, links=links + kept, op_overhead_s=op_overhead,
        matmul_overhead_s=max(mm_fixed - op_overhead, 0.0), overlap=_overlap(top, base),
        pipeline_action_s=base.pipeline_action_s if base else 0.0,
        core_handoff_s=base.core_handoff_s if base else 0.0,
        device=device or (base.device if base else "cpu"),
        cores_per_host=cores_per_host if cores_per_host is not None else (base.cores_per_host if base else 0),
        source=f"calibrated {when} on {len(ranks)} ranks ({hosts}), {len(samples)} samples"
               + (f"; unmeasured fields from {base.name!r}" if base else ""))
    if spec is not None and len(steps) >= 2:
        fitted = _fit_model_steps(fitted, spec, steps, rows, seq_len)
    return _fit_pipeline(_fit_handoff(fitted, top, len(ranks)), top, len(ranks))


def _fit_model_steps(profile: HardwareProfile, spec: ModelSpec, steps: dict[int, float], rows: int,
                     seq_len: int) -> HardwareProfile:
    """The rates and fixed costs scaled by what a real block costs, and step_overhead_s.

    The longer model step less the one-layer one is its extra blocks as the runtime's code runs
    them (transformers' modules, autograd, the optimizer, ranks sharing cores): plan.steptime's
    prediction of those blocks from the microbenchmarks, times k, matches it, so the FLOP rates
    and the memory bandwidth are divided by k and the per-operation costs multiplied by it (one
    factor: on a small model it corrects the dispatch costs, on a larger one the matmul rate;
    a residual fitted alone would be the difference of two noisy times). The one-layer step
    less its prediction is the loop's own cost per step."""

    from .steptime import predict_step

    key = "n_layer" if "n_layer" in spec.config else "num_hidden_layers"
    few, many = min(steps), max(steps)
    one, more = (dataclasses.replace(spec, config={**spec.config, key: n}, source=None) for n in (few, many))
    plan = Plan(batch_size=rows, seq_len=seq_len)

    def seconds(s: ModelSpec, p: HardwareProfile) -> float:
        return predict_step(s, plan, dataclasses.replace(p, step_overhead_s=0.0, cores_per_host=0), memory=False).seconds

    predicted = seconds(more, profile) - seconds(one, profile)
    k = (steps[many] - steps[few]) / predicted if predicted > 0 and steps[many] > steps[few] else 1.0
    scaled = dataclasses.replace(
        profile, flops={p: r / k for p, r in profile.flops.items()}, memory_bandwidth=profile.memory_bandwidth / k,
        op_overhead_s=profile.op_overhead_s * k, matmul_overhead_s=profile.matmul_overhead_s * k)
    return dataclasses.replace(scaled, step_overhead_s=max(steps[few] - seconds(one, scaled), 0.0),
                               source=profile.source + f"; compute x{k:.2f} and per-step cost from {rows}x{seq_len} "
                                                       f"model steps of {few} and {many} layers")


def anchor_step_overhead(profile: HardwareProfile, spec: ModelSpec, plan: Plan, measured_s: float,
                         steps: int) -> HardwareProfile:
    """`profile` with a fixed cost per step taken from `steps` real steps of `plan` (their median,
    `measured_s`): the measured step less `plan`'s prediction without that cost, never below 0.

    Where a replicated wrapper averages `plan`'s gradients (DDP or replicate), the excess is that
    wrapper's hooks and per-bucket or per-unit work, which the model counts only as collectives and
    copies: it becomes replica_overhead_s, and only plans of that kind carry it (a pipeline or
    tensor-parallel plan runs no such hooks; FSDP's are modelled per unit). Under any other plan
    it is the runtime loop's own cost beyond the bare model step's estimate (the stop vote, the
    step's records, the engine's threads beside the ranks): step_overhead_s, which every plan
    carries."""
    from .steptime import predict_step

    if measured_s <= 0 or steps < 1:
        raise CalibrationError(f"an anchor needs measured steps: got {steps} with median {measured_s} s")
    field = "replica_overhead_s" if plan.replicates_gradients else "step_overhead_s"
    bare = predict_step(spec, plan, dataclasses.replace(profile, **{field: 0.0}), memory=False).seconds
    return dataclasses.replace(profile, **{field: max(measured_s - bare, 0.0)},
                               source=profile.source + f"; {field} from {steps} measured steps of "
                                                       f"{plan.describe()} ({measured_s * 1e3:.1f} ms)")


def _fit_links(coll: list[CalibrationSample]) -> list[Link]:
    """One link per (class, op, group size), a send's also as recv's, and per class a '*' link
    fitted to all its collectives."""
    groups: dict[tuple[str, str, int], list[CalibrationSample]] = {}
    for s in coll:
        if s.op not in COLLECTIVE_OPS + ("recv",):
            raise CalibrationError(f"sample {s.name!r}: unknown collective {s.op!r}")
        groups.setdefault((s.link, s.op, s.size), []).append(s)
    links = []
    for (link, op, size), got in sorted(groups.items()):
        latency, rate = fit_line([(s.bytes * bus_factor(op, size), s.seconds) for s in got])
        links.append(Link(link=link, latency_s=latency, bandwidth=rate, op=op, size=size))
        if op == "send" and (link, "recv", size) not in groups:  # no waiting receiver timed: the send's
            links.append(Link(link=link, latency_s=latency, bandwidth=rate, op="recv", size=size))
    for link in sorted({s.link for s in coll}):
        latency, rate = fit_line([(s.bytes * bus_factor(s.op, s.size), s.seconds) for s in coll
                                  if s.link == link and s.op != "recv"])
        links.append(Link(link=link, latency_s=latency, bandwidth=rate))
    return links


def _fit_handoff(profile: HardwareProfile, top: list[CalibrationSample], world: int) -> HardwareProfile:
    """core_handoff_s from the handoff bursts: a burst of L seconds with every rank busy takes
    min(L, h) + (L - h) / v with half of them waiting, v the speed plan.pipeline_time.core_speed
    gives half the ranks; h minimises the squared relative error over the lengths. Unchanged
    without samples, or where the ranks do not share cores (v = 1)."""
    from .pipeline_time import core_speed

    got: dict[int, dict[int, float]] = {}
    for s in (x for x in top if x.what == "handoff"):
        got.setdefault(s.microbatches, {})[s.size] = s.seconds
    pairs = [(d[world], d[world // 2]) for d in got.values() if world in d and world // 2 in d and d[world] > 0]
    # the bursts' layout as a pipeline: pairs of 2 stages, one rank of each pair computing
    speed = core_speed(Plan(pp=2, dp=world // 2), profile) if world >= 2 else None
    v = speed(1) if speed is not None else 1.0
    if not pairs or v <= 1.0 + 1e-9:
        return profile

    def error(h: float) -> float:
        return sum(((min(busy, h) + max(busy - h, 0.0) / v) / alone - 1) ** 2 for busy, alone in pairs)

    longest = max(busy for busy, _ in pairs)
    best = min((longest * i / 400 for i in range(401)), key=error)
    return dataclasses.replace(profile, core_handoff_s=best,
                               source=profile.source + f"; core handoff from {len(pairs)} burst lengths")


def _fit_pipeline(profile: HardwareProfile, top: list[CalibrationSample], world: int) -> HardwareProfile:
    """pipeline_action_s from the pipeline samples: per sample, the fixed cost per action whose
    replay (plan.pipeline_time, 1F1B with every action costing it, the transfers the fitted
    'recv' link, ranks sharing cores as the profile says) lasts the measured step, found by
    bisection; their median. Unchanged without pipeline samples."""
    from .pipeline_time import ActionCost, core_speed, simulate

    costs = []
    for s in (x for x in top if x.what == "pipeline"):
        plan = Plan(pp=s.size, dp=world // s.size, microbatches=s.microbatches, pp_schedule="1f1b",
                    batch_size=s.microbatches * (world // s.size), seq_len=1)
        link = profile.link(s.link, "recv", 2)
        speed = core_speed(plan, profile)

        def replay(o: float, plan: Plan = plan, speed=speed, p2p: float = link.latency_s) -> float:
            return simulate(plan, [ActionCost(o, o)] * plan.n_stages, p2p, speed, profile.core_handoff_s)[0]

        lo, hi = 0.0, s.seconds
        if replay(lo) >= s.seconds:
            costs.append(0.0)
            continue
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if replay(mid) < s.seconds else (lo, mid)
        costs.append((lo + hi) / 2)
    if not costs:
        return profile
    return dataclasses.replace(profile, pipeline_action_s=statistics.median(costs),
                               source=profile.source + f"; {len(costs)} pipeline steps of near-empty stages")


def _overlap(top: list[CalibrationSample], base: HardwareProfile | None) -> float:
    """(t_mm + t_ar - t_both) / min(t_mm, t_ar) of the overlap samples, in [0, 1]; the base's
    (else 1) when there are none."""
    got = {s.op: s.seconds for s in top if s.op in OVERLAP_OPS}
    if not got:
        return base.overlap if base else 1.0
    lacking = [op for op in OVERLAP_OPS if op not in got]
    if lacking:
        raise CalibrationError(f"incomplete overlap measurement: no {lacking} sample")
    t_mm, t_ar, t_both = got[OVERLAP_MATMUL], got[OVERLAP_COLLECTIVE], got[OVERLAP_BOTH]
    return min(max((t_mm + t_ar - t_both) / max(min(t_mm, t_ar), 1e-12), 0.0), 1.0)


def _memory(host_memory: Sequence[HostMemory], base: HardwareProfile | None, coll: list[CalibrationSample],
            n_ranks: int) -> tuple[int, int, str]:
    """(memory_bytes per device, devices per host, 'N host(s)')."""
    if host_memory:
        per_host: dict[str, list[HostMemory]] = {}
        for m in host_memory:
            per_host.setdefault(m.host, []).append(m)
        if all(m.gpu_free is not None for m in host_memory):
            memory = min(int(m.gpu_free) for m in host_memory)
        else:
            memory = min(min(m.available for m in ms) // len(ms) for ms in per_host.values())
        return memory, max(len(ms) for ms in per_host.values()), f"{len(per_host)} host(s)"
    one_host = all(s.link == "intra" for s in coll)
    devices = n_ranks if one_host else (base.devices_per_host if base else 1)
    return (base.memory_bytes if base else 0), devices, "1 host" if one_host else "several hosts"
