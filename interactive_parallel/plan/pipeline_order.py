"""The order of a pipeline schedule on one rank, in plain Python: which action comes next.

Owns one order builder per schedule, each a function of numbers alone (pp, the pipeline rank,
the microbatches, the stages per rank of a looped schedule) giving (action, local stage,
split) in the order that rank runs them in one step: torch's order of forwards and backwards
for GPipe, 1F1B and Interleaved 1F1B, and of forwards, input halves and weight halves for
InterleavedZeroBubble (_get_1f1b_rank_ops with enable_zero_bubble), ZBVZeroBubble and DualPipeV
(its overlapped F/B as its two halves, forward first), written again from
torch.distributed.pipelining.schedules (2.13): plan/ imports no torch, and the activation model
(plan.activation_peak) and the step-time model (plan.pipeline_time) replay the order before any
rank exists. Each schedule's record (plan.schedules) names its builder; Plan.pipeline_ops calls
it. The runtime runs torch's classes themselves; tests/test_activations.py holds this order to
each class's own pipeline_order. Knows nothing of the Plan, of what a stage holds or of time:
only which action comes next.
"""
from __future__ import annotations

from typing import Callable

Op = tuple[str, int, bool]
"""(action, local stage, split): 'F', 'B' or 'W' (a weight half); split is True for the input
half of a zero-bubble backward whose weight half runs apart, False for a full backward (and for
DualPipeV's unsplit halves, which run as one)."""
OrderBuilder = Callable[[int, int, int, int], list[Op]]
"""(pp, pipeline rank, microbatches, virtual stages) -> that rank's ops in one step."""


def gpipe(pp: int, rank: int, m: int, v: int) -> list[Op]:
    """Every forward, then every backward."""
    return [("F", 0, False)] * m + [("B", 0, False)] * m


def one_f_one_b(pp: int, rank: int, m: int, v: int) -> list[Op]:
    """min(microbatches, stages - rank) forwards, then backward-forward pairs, then the remaining backwards."""
    warm = min(m, pp - rank)
    pairs = [op for _ in range(m - warm) for op in (("B", 0, False), ("F", 0, False))]
    return [("F", 0, False)] * warm + pairs + [("B", 0, False)] * warm


def interleaved_1f1b(pp: int, rank: int, m: int, v: int) -> list[Op]:
    """torch's order: depth first, a warm-up of (v - 1) * microbatches per round + 2 * (pp - 1 -
    rank) forwards, then forward-backward pairs, then the remaining backwards."""
    per_round = m // max(1, m // pp)
    warm = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = m * v

    def fwd(op: int) -> int:
        return (op // per_round) % v

    def bwd(op: int) -> int:
        return v - 1 - ((op - warm) // per_round) % v

    order: list[Op] = []
    for op in range(total):
        if op < warm:
            order.append(("F", fwd(op), False))
        else:
            order += [("F", fwd(op), False), ("B", bwd(op), False)]
    order += [("B", bwd(op), False) for op in range(total, total + warm)]
    return order


def _numbered(ops: list[tuple[str, int]], m: int) -> list[Op]:
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


def interleaved_zb(pp: int, rank: int, m: int, v: int) -> list[Op]:
    """Interleaved 1F1B with each backward split, the first `rank` weight halves held to the cool-down."""
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


def zbv(pp: int, rank: int, m: int, v: int) -> list[Op]:
    """ZBVZeroBubble's order, built for max(m, 2 * pp - 1) microbatches, the missing ones left out."""
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


def dualpipev(pp: int, rank: int, m: int, v: int) -> list[Op]:
    """DualPipeV's order, each overlapped forward and backward as its two halves, forward first."""
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
