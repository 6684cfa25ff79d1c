"""Rank-side bodies of the state tests (module level, so spawned ranks can import them):
re-plans that carry the optimizer, checkpoints with optimizer state, recomputation,
verify on one rank, and load-time memory. Each returns plain numbers and tensors from
rank 0 only. Knows nothing of pytest.
"""
from __future__ import annotations


from interactive_parallel.plan import PRESETS, Plan
from interactive_parallel.records import ScratchLayout


def _global_losses(records) -> list[float]:
    from interactive_parallel.runtime.rank import state
    from interactive_parallel.runtime.training.verify import global_loss

    par = state.get().parallel
    return [global_loss(par, r.loss) for r in records]


def continued_runs(rank: int, preset: str, pairs: list[tuple[dict, dict]], steps: int, scratch: str) -> dict:
    """Per (plan A, plan B): losses of `steps` under A, re-plan to B, `steps` more; and of
    2 x `steps` under A alone and under B alone."""
    from interactive_parallel.runtime import api

    api.load_model(PRESETS[preset])
    out = {}
    for a, b in pairs:
        label = f"{Plan(**a).describe()}->{Plan(**b).describe()}"
        runs = {}
        api.load_model(PRESETS[preset])
        api.apply_plan(Plan(**a))
        first = _global_losses(api.train(steps))
        info = api.apply_plan(Plan(**b), ScratchLayout(scratch))
        runs["replanned"] = first + _global_losses(api.train(steps))
        runs["state"], runs["step"] = info.state, info.step
        for which, fields in (("a", a), ("b", b)):
            api.load_model(PRESETS[preset])
            api.apply_plan(Plan(**fields))
            runs[which] = _global_losses(api.train(2 * steps))
        out[label] = runs
    return out if rank == 0 else {}


def checkpoint_round_trip(rank: int, preset: str, save_plan: dict, load_plan: dict, steps: int, path: str,
                          other: str) -> dict:
    """Train `steps` under one plan, save, train on; load under another plan and train `steps`:
    the losses after the load repeat those after the save. Then a checkpoint of another model
    is refused and leaves the weights and the step as they were."""
    import torch

    from interactive_parallel.runtime import api
    from interactive_parallel.runtime.rank import state

    api.load_model(PRESETS[preset])
    api.apply_plan(Plan(**save_plan))
    api.train(steps)
    info_save = api.save_checkpoint(path)
    after_save = _global_losses(api.train(steps))
    api.apply_plan(Plan(**load_plan))
    info_load = api.load_checkpoint(path)
    after_load = _global_losses(api.train(steps))
    before, step = api.full_state_dict(), state.get().step
    refused = ""
    try:
        api.load_checkpoint(other)
    except ValueError as exc:
        refused = str(exc)
    after = api.full_state_dict()
    unchanged = all(torch.equal(v, after[k]) for k, v in before.items()) and state.get().step == step
    out = {"after_save": after_save, "after_load": after_load, "info_save": info_save, "info_load": info_load,
           "refused": refused, "unchanged": unchanged}
    return out if rank == 0 else {}


def save_other_model(rank: int, preset: str, path: str) -> bool:
    from interactive_parallel.runtime import api

    api.load_model(PRESETS[preset])
    api.apply_plan(Plan(dp=2))
    api.save_checkpoint(path)
    return True


def load_peak_rss(rank: int, config: dict, fields: dict, warm: dict) -> dict:
    """Peak RSS while one rank lays out `config` under `fields`, beyond its RSS just before.

    A small model of the same family is laid out first, so imports and one-off set-up are
    not counted; the kernel's peak counter (VmHWM) is reset just before the measured load.
    """
    from interactive_parallel.plan.models import spec_from_config_dict
    from interactive_parallel.runtime import api
    from interactive_parallel.runtime.probes.memory import peak_rss, reset_peak_rss

    api.load_model(spec_from_config_dict(warm, name="warm-up"))
    api.apply_plan(Plan(**fields))
    api.load_model(spec_from_config_dict(config, name="measured"))
    before = reset_peak_rss()
    api.apply_plan(Plan(**fields))
    peak = peak_rss()
    return {"before": before, "peak": peak, "rank": rank}


def verify_on_one_rank(rank: int, preset: str, fields: dict) -> dict:
    """verify() after a step (the same report on every rank), and verify() told that rank 0
    has 1 MiB: a report that says why it did not run, with the numbers."""
    from interactive_parallel.runtime import api

    api.load_model(PRESETS[preset])
    api.apply_plan(Plan(**fields))
    api.train(1)
    return {"ok": api.verify(), "refused": api.verify(limit_bytes=2**20)}


def weights_from_directory(rank: int, path: str, plans: list[dict]) -> dict:
    """Full weights of a local model directory as laid out under each plan (each rank reads
    only its slices)."""
    from interactive_parallel.plan import resolve_model
    from interactive_parallel.runtime import api

    out = {}
    for fields in plans:
        api.load_model(resolve_model(path))
        api.apply_plan(Plan(**fields))
        out[Plan(**fields).describe()] = api.full_state_dict()
    return out if rank == 0 else {}


def weights_from_full_state(rank: int, preset: str, plans: list[dict]) -> dict:
    """Per plan: whether the layout built from a full state dict holds exactly those weights."""
    import torch

    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.model.models import build_model

    full = build_model(PRESETS[preset], seed=5).state_dict()
    out = {}
    for fields in plans:
        par = parallelize(PRESETS[preset], Plan(**fields), state_dict=full)
        mine = par.full_state_dict()
        out[Plan(**fields).describe()] = all(torch.equal(mine[k], full[k]) for k in mine)
    return out if rank == 0 else {}
