"""Will a plan fit the ranks' machines? Predicted bytes against what the machines have free.

Owns the comparison the client makes before it lays a model out: plan.estimate's
per-rank prediction (parameters, gradients, optimizer state, activations, gathered weights), summed over
the ranks that share a host (their host memory) or taken per rank (its GPU), against
the free bytes the ranks reported (runtime/api.py host_memory). Bytes the layout being
replaced holds are counted as free (it is released before the new one is built), minus
the state a re-plan stages on tmpfs in between (weights and optimizer state, once).
Pure Python: knows no torch and no processes; every number in a refusal comes from here.
"""
from __future__ import annotations

import math

from ..records import HostMemory
from .estimate import param_inventory, predict_memory, rank_peak
from .models import ModelSpec
from .plan import Plan


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def rank_bytes(spec: ModelSpec, plan: Plan) -> list[int]:
    """Predicted peak bytes per rank: parameters + gradients + optimizer state + activations, and
    the weights FSDP keeps gathered under a pipeline (plan.estimate.rank_peak)."""
    return [rank_peak(spec, plan, m) for m in predict_memory(spec, plan)]


def memory_problems(spec: ModelSpec, plan: Plan, facts: list[HostMemory], current: tuple[ModelSpec, Plan] | None = None,
                    staged_on_host: bool = True) -> list[str]:
    """Why `plan` of `spec` would not fit, one line per host (CPU) or rank (CUDA), naming the
    predicted and the available bytes; empty when it fits.

    facts: per rank (in rank order) what its machine has free (HostMemory, from runtime host_memory).
    current: the (spec, plan) laid out now, whose bytes are released first, or None.
    staged_on_host: a re-plan writes the current state to host tmpfs before the new layout loads it.
    """
    need = rank_bytes(spec, plan)
    held = rank_bytes(*current) if current else [0] * len(facts)
    # fp32 weights and AdamW's two moments, once each however many ranks replicate them
    staged = 12 * sum(math.prod(p.shape) for p in param_inventory(current[0])) if current and staged_on_host else 0
    problems = []
    if plan.device == "cuda":
        for rank, f in enumerate(facts):
            free = (f.gpu_free or 0) + held[rank]
            if need[rank] > free:
                problems.append(f"rank {rank}: {spec.name} under {plan.describe()} is predicted to need "
                                f"{_gib(need[rank])} ({need[rank]:,} bytes) of GPU memory; its GPU has "
                                f"{_gib(free)} ({free:,} bytes) available")
        return problems
    hosts: dict[str, list[int]] = {}
    for rank, f in enumerate(facts):
        hosts.setdefault(f.host, []).append(rank)
    for host, ranks in hosts.items():
        total = sum(need[r] for r in ranks)
        free = facts[ranks[0]].available + sum(held[r] for r in ranks) - staged
        if total > free:
            worst = max(need[r] for r in ranks)
            problems.append(f"host {host}: {spec.name} under {plan.describe()} is predicted to need "
                            f"{_gib(total)} ({total:,} bytes) for its {len(ranks)} rank(s) (up to {_gib(worst)} "
                            f"each: parameters, gradients, optimizer state, activations); the host has "
                            f"{_gib(free)} ({free:,} bytes) available")
    return problems
