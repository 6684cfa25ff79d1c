"""Rank-side bodies of the state tests (module level, so spawned ranks can import them):
re-plans that carry the optimizer, checkpoints with optimizer state, recomputation,
verify on one rank, and load-time memory. Each returns plain numbers and tensors from
rank 0 only. Knows nothing of pytest.
"""
from __future__ import annotations

import os

from interactive_parallel.plan import PRESETS, Plan


def _global_losses(records) -> list[float]:
    from interactive_parallel.runtime import state
    from interactive_parallel.runtime.verify import global_loss

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
        info = api.apply_plan(Plan(**b), scratch)
        runs["replanned"] = first + _global_losses(api.train(steps))
        runs["state"], runs["step"] = info["state"], info["step"]
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
    is refused and leaves the weights as they were."""
    import torch

    from interactive_parallel.runtime import api

    api.load_model(PRESETS[preset])
    api.apply_plan(Plan(**save_plan))
    api.train(steps)
    info_save = api.save_checkpoint(path)
    after_save = _global_losses(api.train(steps))
    api.apply_plan(Plan(**load_plan), os.path.join(os.path.dirname(path), "scratch"))
    info_load = api.load_checkpoint(path)
    after_load = _global_losses(api.train(steps))
    before = api.full_state_dict()
    api.save_checkpoint(other + "-mine")  # noqa: just a sanity write under the second plan
    refused = ""
    try:
        api.load_checkpoint(other)
    except ValueError as exc:
        refused = str(exc)
    unchanged = all(torch.equal(v, api.full_state_dict()[k]) for k, v in before.items())
    out = {"after_save": after_save, "after_load": after_load, "info_save": info_save, "info_load": info_load,
           "refused": refused, "unchanged": unchanged}
    return out if rank == 0 else {}


def save_other_model(rank: int, preset: str, path: str) -> bool:
    from interactive_parallel.runtime import api

    api.load_model(PRESETS[preset])
    api.apply_plan(Plan(dp=2))
    api.save_checkpoint(path)
    return True
