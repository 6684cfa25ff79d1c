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


def parity_group(rank: int, configs: list[tuple[str, str, dict]], steps: int) -> dict:
    """{label: train_and_grads(...)} for each (label, preset, plan fields); rank 0 returns."""
    out = {}
    for label, preset, fields in configs:
        out[label] = train_and_grads(PRESETS[preset], Plan(**fields), steps)
    return out if rank == 0 else {}


def reference(preset: str, fields: dict, steps: int) -> dict:
    """The same run in this process alone (no process group)."""
    from interactive_parallel.runtime.verify import reference_plan

    plan = reference_plan(Plan(**fields))
    return train_and_grads(PRESETS[preset], plan, steps)


PROMPTS = ["12+35=", "7+8=", "99+1="]


def generate_group(rank: int, plans: list[dict], max_new_tokens: int) -> dict:
    """Greedy and sampled completions under each plan, from every rank (they must agree)."""
    import dataclasses

    from interactive_parallel.runtime import api, state

    api.load_model(dataclasses.asdict(PRESETS["tiny-llama"]))
    out = {}
    for fields in plans:
        api.apply_plan(Plan(**fields).to_dict())
        greedy = api.generate(PROMPTS, max_new_tokens, {})
        sampled = api.generate(PROMPTS, max_new_tokens, {"do_sample": True, "top_k": 20, "seed": 3})
        raw = state.get().parallel.raw
        sp_norm = type(raw.get_submodule("model.layers.0.input_layernorm").weight).__name__
        out[Plan(**fields).describe() + ("-sp" if fields.get("sequence_parallel") else "")] = {
            "greedy": greedy, "sampled": sampled, "norm_type": sp_norm}
    return out


def reference_generate(max_new_tokens: int) -> list[str]:
    from interactive_parallel.runtime.generate import generate
    from interactive_parallel.runtime.parallelize import parallelize

    par = parallelize(PRESETS["tiny-llama"], Plan())
    return generate(par, PROMPTS, max_new_tokens)


def _logits(ids):
    from interactive_parallel.runtime import state

    return state.get().parallel.forward_logits(ids).detach().clone()


def replan_group(rank: int, preset: str, save_plan: dict, replan: dict, load_plan: dict, path: str) -> dict:
    """Hot re-plan and checkpoint round trip through runtime.api; rank 0 returns the logits seen."""
    import dataclasses

    from interactive_parallel.runtime import api
    from interactive_parallel.runtime.data import global_batch

    ids = global_batch(7, 0, 2, 16)[:, :-1]
    api.load_model(dataclasses.asdict(PRESETS[preset]))
    api.apply_plan(Plan(**save_plan).to_dict())
    api.train_step()  # move the weights off their seeded init
    before = _logits(ids)
    verified = api.verify()
    api.save_checkpoint(path)
    api.apply_plan(Plan(**replan).to_dict())  # hot re-plan: the weights carry over
    replanned = _logits(ids)
    api.apply_plan(Plan(**load_plan).to_dict())
    api.train_step()  # change the weights, so the load has something to undo
    changed = _logits(ids)
    info = api.load_checkpoint(path)
    loaded = _logits(ids)
    verified_after = api.verify()
    result = {"before": before, "replanned": replanned, "changed": changed, "loaded": loaded, "info": info,
              "verify": verified, "verify_after": verified_after}
    return result if rank == 0 else {"verify": verified}
