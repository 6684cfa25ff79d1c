"""Rank-side bodies of the multi-rank tests (module level, so spawned ranks can import them).

Each worker runs several plans in one spawned group, tearing down and re-applying, and
returns plain tensors and numbers from rank 0 only. Knows nothing of pytest.
"""
from __future__ import annotations

from interactive_parallel.plan import PRESETS, Plan


def train_and_grads(spec, plan: Plan, steps: int) -> dict:
    """Per-step global losses, then loss/full grads on the next batch and the full weights."""
    from interactive_parallel.runtime import state
    from interactive_parallel.runtime.parallelize import parallelize
    from interactive_parallel.runtime.train import make_optimizer, train_step
    from interactive_parallel.runtime.verify import global_loss, loss_and_grads

    par = parallelize(spec, plan)
    opt = make_optimizer(par)
    losses = []
    for step in range(steps):
        rec = train_step(par, opt, step)
        losses.append(global_loss(par, rec.loss))
    loss, grads = loss_and_grads(par, steps)
    weights = par.full_state_dict()
    state.get().reset_model()
    return {"losses": losses + [loss], "grads": grads, "weights": weights}


def parity_group(rank: int, configs: list[tuple[str, dict]], steps: int) -> dict:
    """{label: train_and_grads(...)} for each (preset, plan fields) in `configs`; rank 0 returns."""
    out = {}
    for preset, fields in configs:
        plan = Plan(**fields)
        result = train_and_grads(PRESETS[preset], plan, steps)
        out[f"{preset}:{plan.describe()}:{plan.pp_schedule if plan.pp > 1 else ''}"] = result
    return out if rank == 0 else {}


def reference(preset: str, fields: dict, steps: int) -> dict:
    """The same run in this process alone (no process group)."""
    from interactive_parallel.runtime.verify import reference_plan

    plan = reference_plan(Plan(**fields))
    return train_and_grads(PRESETS[preset], plan, steps)
