"""The pipeline's step in time: the schedule's order replayed with each action's duration.

Owns the replay plan.steptime reads for the bubble: each pipeline rank runs its forwards,
backwards and weight halves in the order plan.plan.schedule_order gives (its schedule record's
builder in plan.pipeline_order: torch's order, written again), an action starting once its rank
is free and its input has arrived from the neighbouring stage; on a CPU whose ranks share cores, the
busy ranks compute faster while the others wait. Knows nothing of FLOPs, bytes or links: the
durations and the transfer time come from its caller. Pure Python: knows no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..records import HardwareProfile
from .inventory import Memo
from .plan import Plan, schedule_order


@dataclass(frozen=True)
class ActionCost:
    """Seconds of one microbatch's forward, backward and (zero-bubble) weight half on one stage."""

    f: float
    b: float
    w: float = 0.0


def _orders(plan: Plan) -> dict[int, list[tuple[str, int, int]]]:
    """Pipeline rank -> its (action, stage, microbatch) in the schedule's order."""
    return _ORDERS.get_or_make((plan.pp, plan.pp_schedule, plan.n_microbatches, plan.virtual_stages),
                               lambda: _replayed(plan))


_ORDERS = Memo(1024)


def _replayed(plan: Plan) -> dict[int, list[tuple[str, int, int]]]:
    orders = {}
    for r in range(plan.pp):
        seen: dict[tuple[str, int], int] = {}
        acts = []
        for action, local in schedule_order(plan, r):
            stage = plan.stage_ids(r)[local]
            mb = seen.get((action, stage), 0)
            seen[(action, stage)] = mb + 1
            acts.append((action, stage, mb))
        orders[r] = acts
    return orders


def _needs(action: str, stage: int, mb: int, last: int) -> tuple[str, int, int] | None:
    """The action whose output this one waits for (None: the step's input)."""
    if action == "F":
        return ("F", stage - 1, mb) if stage > 0 else None
    if action == "B":
        return ("B", stage + 1, mb) if stage < last else ("F", stage, mb)
    return ("B", stage, mb)


def simulate(plan: Plan, costs: list[ActionCost], p2p_s: float,
             speed: Callable[[int], float] | None = None, handoff_s: float = 0.0) -> tuple[float, dict[int, float]]:
    """(seconds of one pass of the pipeline schedule, pipeline rank -> seconds it computes).

    Each rank runs its actions in the schedule's order; an action starts once its rank is free
    and its input has arrived (a forward after the previous stage's forward of its microbatch, a
    backward after the next stage's, `p2p_s` later when another rank sent it). `speed(k)`: how
    fast an action runs while k ranks of the pipeline compute at once, relative to its cost (on
    a CPU whose ranks share cores, idle ranks leave theirs to the busy ones); None: always 1.
    `handoff_s`: how long an action computes at speed 1 before a core left idle speeds it (the
    OS scheduler's time slice: an action shorter than that ends before the core changes hands)."""
    if speed is not None:
        return _shared_cores(plan, costs, p2p_s, speed, handoff_s)
    orders, last = _orders(plan), plan.n_stages - 1
    owner = [plan.stage_owner(s) for s in range(plan.n_stages)]
    done: dict[tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in orders}
    busy = {r: 0.0 for r in orders}
    nxt = {r: 0 for r in orders}
    left = sum(len(a) for a in orders.values())
    while left:
        moved = False
        for r, acts in orders.items():
            while nxt[r] < len(acts):
                key = acts[nxt[r]]
                dep = _needs(*key, last)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (p2p_s if owner[dep[1]] != r else 0.0)
                c = costs[key[1]]
                took = c.f if key[0] == "F" else c.b if key[0] == "B" else c.w
                free[r] = done[key] = max(free[r], ready) + took
                busy[r] += took
                nxt[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError(f"the {plan.pp_schedule} order of {plan.describe()} waits on itself")
    return max(free.values()), busy


def _shared_cores(plan: Plan, costs: list[ActionCost], p2p_s: float, speed: Callable[[int], float],
                  handoff_s: float = 0.0) -> tuple[float, dict[int, float]]:
    """simulate's replay in time: each running action runs at speed 1 for its first `handoff_s`,
    then at speed(ranks running). Its tensor / context / expert collectives too: their calibrated
    cost is mostly the wait for peers that share cores with busy ranks, which idle ranks shorten
    as they shorten compute."""
    orders, last = _orders(plan), plan.n_stages - 1
    took = {"F": lambda c: c.f, "B": lambda c: c.b, "W": lambda c: c.w}
    done: dict[tuple[str, int, int], float] = {}
    nxt = {r: 0 for r in orders}
    running: dict[int, list] = {}  # rank -> [key, work left, run for]
    active = {r: 0.0 for r in orders}
    t = 0.0
    while any(nxt[r] < len(a) for r, a in orders.items()) or running:
        arrivals = []
        for r, acts in orders.items():
            if r in running or nxt[r] >= len(acts):
                continue
            key = acts[nxt[r]]
            dep = _needs(*key, last)
            ready = 0.0 if dep is None else done.get(dep, math.inf)
            if dep is not None and ready < math.inf and plan.stage_owner(dep[1]) != r:
                ready += p2p_s
            if ready <= t + 1e-12:
                running[r] = [key, took[key[0]](costs[key[1]]), 0.0]
                nxt[r] += 1
            elif ready < math.inf:
                arrivals.append(ready)
        if not running:
            if not arrivals:
                raise RuntimeError(f"the {plan.pp_schedule} order of {plan.describe()} waits on itself")
            t = min(arrivals)
            continue
        fast = speed(len(running))

        def rate(x: list) -> float:
            return fast if x[2] >= handoff_s - 1e-12 else 1.0

        # the next event: an action ends, one reaches the handoff, or an input arrives
        dt = min([min(x[1], handoff_s - x[2]) if rate(x) == 1.0 and fast != 1.0 else x[1] / rate(x)
                  for x in running.values()] + [a - t for a in arrivals])
        t += dt
        for r in list(running):
            x = running[r]
            x[1] -= dt * rate(x)
            x[2] += dt
            active[r] += dt
            if x[1] <= 1e-12:
                done[running.pop(r)[0]] = t
    return t, active


def core_speed(plan: Plan, profile: HardwareProfile) -> Callable[[int], float] | None:
    """speed(k) for simulate: with cores_per_host set (ranks sharing a CPU's cores, one thread each),
    a rank computes min(1, cores / busy ranks of its host) core's worth; its costs were measured with
    every rank of the host busy, so speed is relative to that. Every pipeline group of the host
    runs the same schedule at once (data-parallel peers keep step)."""
    cores, host = profile.cores_per_host, min(profile.devices_per_host, plan.world_size)
    if not cores:
        return None
    groups = max(1, host // plan.pp) if plan.pp <= host else 1
    per_host = min(plan.pp, host)
    full = min(1.0, cores / host)
    return lambda k: min(1.0, cores / max(1, min(k, per_host) * groups)) / full
