"""The order of a pipeline schedule on one rank, in plain Python: which action comes next.

Owns torch's order of forwards and backwards for GPipe, 1F1B and Interleaved 1F1B
(`schedule_order`), and of forwards, input halves and weight halves for InterleavedZeroBubble
(_get_1f1b_rank_ops with enable_zero_bubble), ZBVZeroBubble and DualPipeV (its overlapped
F/B as its two halves, forward first: `zero_bubble_ops`), written again from
torch.distributed.pipelining.schedules (2.13): plan/ imports no torch, and the activation
model (plan.activation_peak) and the step-time model (plan.pipeline_time) replay the order
before any rank exists. The runtime runs torch's classes themselves; tests/test_activations.py
holds this order to each class's own pipeline_order. Knows nothing of what a stage holds or of
time: only which action comes next.
"""
from __future__ import annotations

from .plan import Plan


def schedule_order(plan: Plan, pp_rank: int) -> list[tuple[str, int]]:
    """('F' | 'B', local stage index) in the order this pipeline rank runs them in one step.

    GPipe: every forward, then every backward. 1F1B: min(microbatches, stages - stage)
    forwards, then backward-forward pairs, then the remaining backwards. Interleaved 1F1B:
    torch's order (depth first, warm-up of (v - 1) * microbatches per round + 2 * (pp - 1 -
    rank) forwards, then forward-backward pairs). Zero bubble (interleaved-zb, zbv, dualpipev):
    'B' is the input half of a backward and 'W' its weight half (plan.pipeline_order).
    """
    if plan.zero_bubble:
        return [(a, local) for a, local, _ in zero_bubble_ops(plan, pp_rank)]
    m = plan.n_microbatches
    if plan.pp_schedule == "gpipe":
        return [("F", 0)] * m + [("B", 0)] * m
    if plan.pp_schedule == "1f1b":
        warm = min(m, plan.n_stages - pp_rank)
        return [("F", 0)] * warm + [op for _ in range(m - warm) for op in (("B", 0), ("F", 0))] + [("B", 0)] * warm
    v, pp = plan.virtual_stages, plan.pp
    per_round = m // max(1, m // pp)
    warm = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), m * v)
    total = m * v

    def fwd(op: int) -> int:
        return (op // per_round) % v

    def bwd(op: int) -> int:
        return v - 1 - ((op - warm) // per_round) % v

    order: list[tuple[str, int]] = []
    for op in range(total):
        if op < warm:
            order.append(("F", fwd(op)))
        else:
            order += [("F", fwd(op)), ("B", bwd(op))]
    order += [("B", bwd(op)) for op in range(total, total + warm)]
    return order


def zero_bubble_ops(plan: Plan, pp_rank: int) -> list[tuple[str, int, bool]]:
    """(action, local stage, split) in the order pipeline rank `pp_rank` runs them in one step:
    'F', 'B' (the input half of a backward) or 'W' (its weight half); split is False for the two
    halves of a full backward (DualPipeV's), which run as one."""
    if plan.pp_schedule == "zbv":
        return _zbv_ops(plan.pp, pp_rank, plan.n_microbatches)
    if plan.pp_schedule == "dualpipev":
        return _dualpipev_ops(plan.pp, pp_rank, plan.n_microbatches)
    return _interleaved_zb_ops(plan.pp, pp_rank, plan.n_microbatches, plan.virtual_stages)


def _numbered(ops: list[tuple[str, int]], m: int) -> list[tuple[str, int, bool]]:
    """(action, local stage, split), each (action, stage)'s microbatches counted in order and
    those >= m left out (ZBV plans for more); a full backward 'BW' becomes 'B' and 'W' unsplit."""
    seen: dict[tuple[str, int], int] = {}
    out = []
    for action, local in ops:
        for a in ("B", "W") if action == "BW" else (action,):
            mb = seen.get((a, local), 0)
            seen[(a, local)] = mb + 1
            if mb < m:
                out.append((a, local, action != "BW" and a != "F"))
    return out


def _interleaved_zb_ops(pp: int, rank: int, m: int, v: int) -> list[tuple[str, int, bool]]:
    per_round = m // max(1, m // pp)
    total = v * m
    warm = min((v - 1) * per_round + (pp - 1 - rank), total)

    def fwd(op: int) -> int:
        return (op // per_round) % v

    def bwd(op: int) -> int:
        return v - 1 - ((op - warm) // per_round) % v

    ops: list[tuple[str, int]] = []
    backs: list[int] = []
    weights = 0
    for op in range(warm + total):
        if op < warm:
            ops.append(("F", fwd(op)))
            continue
        if op < total:
            ops.append(("F", fwd(op)))
        ops.append(("B", bwd(op)))
        backs.append(op)
        if op - warm >= rank:  # the first `rank` weight halves wait for the cool-down
            ops.append(("W", bwd(backs[weights])))
            weights += 1
    ops += [("W", bwd(op)) for op in backs[weights:]]
    return _numbered(ops, m)


def _zbv_ops(pp: int, rank: int, m: int) -> list[tuple[str, int, bool]]:
    n = max(2 * pp - 1, m)
    ops: list[tuple[str, int]] = [("F", 0)] * (2 * (pp - rank) - 1)
    ops += [("F", 1), ("F", 0)] * rank
    ops += [("F", 1), ("B", 1), ("W", 1)] * (pp - rank)
    f0, f1 = 2 * (pp - rank) - 1 + rank, rank + pp - rank
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(("F", 0))
            f0 += 1
        ops += [("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)]
        f1 += 1
    ops += [("B", 0), ("B", 1)] * rank
    ops += [("B", 0), ("W", 0)] * (pp - rank)
    b0 = sum(a == "B" for a, s in ops if s == 0)
    w0, w1 = sum(a == "W" for a, s in ops if s == 0), sum(a == "W" for a, s in ops if s == 1)
    ops += [("W", 1)] * (f1 - w1) + [("W", 0)] * (b0 - w0)
    return _numbered(ops, m)


def _dualpipev_ops(pp: int, rank: int, m: int) -> list[tuple[str, int, bool]]:
    ops: list[tuple[str, int]] = []
    pending: list[int] = []  # input halves whose weight half has not run

    def back(local: int, split: bool) -> None:
        ops.append(("B", local) if split else ("BW", local))
        if split:
            pending.append(local)

    def weight() -> None:
        if pending:
            ops.append(("W", pending.pop(0)))

    ops += [("F", 0)] * ((pp - rank - 1) * 2)
    ops += [("F", 0), ("F", 1)] * (rank + 1)
    for _ in range(pp - rank - 1):
        back(1, True)
        weight()
        ops.append(("F", 1))
    for i in range(m - 2 * pp + rank + 1):
        ops += [("F", 0), ("BW", 1)]  # overlapped (rank pp - 1 runs its first pair apart): one order
        ops += [("F", 1), ("BW", 0)]
    for _ in range(pp - rank - 1):
        ops += [("BW", 1), ("F", 1), ("BW", 0)]
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        back(1, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        back(0, split)
    for _ in range(pp - rank - 1):
        weight()
        back(0, split)
    for _ in range(rank + 1):
        weight()
    return _numbered(ops, m)
