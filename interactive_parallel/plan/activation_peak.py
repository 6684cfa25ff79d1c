"""The activation model's peak: when the sets one forward saves (plan.activations) are live at
once on a rank during a training step, and the bytes held then.

Owns replaying the step. Without a pipeline the peak comes at the end of the forward or, under
recomputation, in the first block's backward, with that block's recomputed set live and the head's
tensors freed. Under a pipeline schedule, several micro-batches are in flight: the schedule's order
of forwards, backwards and weight halves (Plan.pipeline_ops: its record's builder in
plan.pipeline_order, GPipe, 1F1B and Interleaved 1F1B as torch orders them, and the zero-bubble
ones, whose input halves keep a micro-batch's graph until its weight half) is replayed action by
action, with the autocast weight copies a recomputing backward makes cached from the first backward
on (a schedule runs its backwards inside the step's autocast region). `predict_activations(spec,
plan, rank)` is the model's answer (plan.estimate reads it). Knows nothing of what a forward saves
beyond the Parts plan.activations gives, nor of torch.
"""
from __future__ import annotations

from .activations import (FP32, Parts, act_bytes, extra_weights, micro_rows, once_per_forward, once_per_step,
                          recomputed_in_backward, stage_parts, weight_elements)
from .axes import MeshAxis, mesh_coords
from .models import ModelSpec
from .plan import Plan


def peak_parts(spec: ModelSpec, plan: Plan, rank: int) -> tuple[Parts, int]:
    """(what the in-flight micro-batches hold at the step's peak, what is held once per step)."""
    coords = mesh_coords(rank, plan.mesh_shape)
    rows = micro_rows(plan)
    extra = Parts() if plan.recompute == "none" else recomputed_in_backward(spec, plan, rows, rank)
    if plan.pp == 1:
        forward = stage_parts(spec, plan, 0, rows)
        # Under recomputation the peak may come in the first block's backward: the head's
        # tensors are freed by then, the block's recomputed set is live.
        backward = forward + extra + Parts(head=-once_per_forward(spec, plan, rows, False, True).head)
        return max(forward, backward, key=lambda p: p.total), once_per_step(spec, plan, rank)
    stages = plan.stage_ids(coords[MeshAxis.PP])
    parts = [stage_parts(spec, plan, s, rows) for s in stages]
    # A schedule runs its backwards inside the step's one autocast region: the weight copies the
    # recomputed blocks make come from (and stay in) its cache, all of them from the first backward.
    cached = Parts()
    if plan.recompute != "none" and act_bytes(plan) != FP32 and not plan.gathers_bf16:
        cached = Parts(linear_inputs=weight_elements(spec, plan, rank, last=False) * act_bytes(plan))
        extra = extra + Parts(linear_inputs=-extra_weights(spec, plan, rank))
    ops = plan.pipeline_ops(coords[MeshAxis.PP])
    return _replayed_peak(plan, stages, parts, ops, cached, extra), once_per_step(spec, plan, rank)


def _replayed_peak(plan: Plan, stages: list[int], parts: list[Parts], ops: list, cached: Parts, extra: Parts) -> Parts:
    """What this pipeline rank holds at its peak, the schedule's actions replayed in order:
    `parts` per local stage and microbatch in flight, `cached` the autocast weight copies of the
    first backward on, `extra` a block's recomputed set during a backward (peak_parts)."""
    # Zero bubble: torch's input half ('B') keeps the graph (retain_graph) for the weight half
    # ('W'), so a microbatch's saved tensors stay until its 'W'; on the last stage its blocks'
    # stay until the step ends (the schedule keeps each microbatch's loss, and the graph with
    # it). The first stage has no input grad: its whole backward runs at 'W'. A full backward
    # (DualPipeV's unsplit halves) frees at 'B' as 1F1B's does. Measured on gloo: exact off
    # the last stage, within 5% on it (tests/test_activations).
    bodies = [p + Parts(head=-p.head) for p in parts]
    best, after = Parts(), Parts()
    held, waiting, kept = [0] * len(stages), [0] * len(stages), [0] * len(stages)

    def live_now(state: tuple) -> Parts:
        held_, waiting_, kept_, after_ = state
        return sum((p.scaled(n + w) for p, n, w in zip(parts, held_, waiting_)), Parts()) + after_ + \
            sum((b.scaled(k) for b, k in zip(bodies, kept_)), Parts())

    # The live total kept as a number and the state at the peak remembered, so the Parts are summed
    # once (a schedule of a thousand actions, on each of a search's candidates)
    sizes, body_sizes, live = [p.total for p in parts], [b.total for b in bodies], 0
    top, peak, at_backward = 0, None, None
    for action, local, split in ops:
        whole = plan.zero_bubble and stages[local] == 0  # its backward all runs at 'W'
        if action == ("W" if whole else "B"):  # the microbatch's blocks run again while it is held
            live += cached.total - after.total
            after = cached
            if live + extra.total - parts[local].head > top:
                top, peak, at_backward = live + extra.total - parts[local].head, (held[:], waiting[:], kept[:], after), local
        if action == "F":
            held[local] += 1
            live += sizes[local]
        elif whole:
            held[local] -= action == "W"
            live -= sizes[local] * (action == "W")
        elif action == "B":
            held[local] -= 1
            waiting[local] += split
            live -= sizes[local] * (1 - split)
        elif split:
            waiting[local] -= 1
            live -= sizes[local]
            if stages[local] == plan.n_stages - 1:
                kept[local] += 1
                live += body_sizes[local]
        if live > top:
            top, peak, at_backward = live, (held[:], waiting[:], kept[:], after), None
    if peak is not None:
        best = live_now(peak)
        if at_backward is not None:
            best = best + extra + Parts(head=-parts[at_backward].head)
    return best


def predict_activations(spec: ModelSpec, plan: Plan, rank: int) -> int:
    """Peak bytes saved for backward on `rank` during one training step (see the module docstring)."""
    parts, once = peak_parts(spec, plan, rank)
    return parts.total + once
