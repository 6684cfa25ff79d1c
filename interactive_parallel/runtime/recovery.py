"""Where a new layout's state comes from: the plan's seed, the layout it replaces, shards a rank
kept across a re-formed process group, or the newest snapshot.

Owns building the rank's layout for apply_plan and filling it from one of those sources,
and `keep`: a rank's own shards of weights and optimizer state, held by reference (no
copy, no collective) while its process group is torn down and formed again, for the
same plan on the same ranks (a failed collective, switching debug mode). Whole copies
never: carried layouts and snapshots go through torch.distributed.checkpoint
(runtime.checkpoint). Knows nothing of the client; the caller says which source.
"""
from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from .pieces import local_block

SOURCES = ("kept", "snapshot")


def keep(par, optimizer, step: int) -> dict[str, Any]:
    """This rank's local shards (weights, optimizer state) by canonical name, and the step."""
    from .initialize import owned_parameters

    parts: dict[str, torch.Tensor] = {}
    for name, p in owned_parameters(par).items():
        parts[f"model.{name}"] = local_block(p.detach())[0]
        for field, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                parts[f"optim.{name}.{field}"] = local_block(v)[0]
    return {"plan": par.plan, "rank": dist.get_rank() if dist.is_initialized() else 0, "step": step,
            "parts": parts}


@torch.no_grad()
def restore_kept(par, optimizer, kept: dict[str, Any]) -> int:
    """Copy kept shards into a layout of the same plan on the same rank; returns the step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from .initialize import owned_parameters

    rank = dist.get_rank() if dist.is_initialized() else 0
    if kept["plan"] != par.plan or kept["rank"] != rank:
        raise RuntimeError(f"rank {rank}: kept shards belong to plan {kept['plan'].describe()} on rank "
                           f"{kept['rank']}, not {par.plan.describe()} on rank {rank}")
    parts = kept["parts"]
    if any(k.startswith("optim.") for k in parts):
        get_optimizer_state_dict(par.raw, optimizer)  # creates the AdamW state to copy into
    for name, p in owned_parameters(par).items():
        targets = {f"model.{name}": p}
        targets.update({f"optim.{name}.{f}": v for f, v in optimizer.state.get(p, {}).items()
                        if isinstance(v, torch.Tensor)})
        for key, target in targets.items():
            local = local_block(target.detach() if key.startswith("model.") else target)[0]
            src = parts[key]
            if src.shape != local.shape:
                raise RuntimeError(f"rank {rank}: kept {key} has shape {tuple(src.shape)}, the layout "
                                   f"{tuple(local.shape)}")
            local.copy_(src)
    return int(kept["step"])


def rebuild(st, plan, device, scratch: str | None, restore: str | None) -> tuple[str, int]:
    """Build `plan`'s layout on this rank into `st` and fill it; (how it was filled, step)."""
    from .checkpoint import drop_snapshots_after, latest_snapshot, load_parts
    from .parallelize import parallelize
    from .train import make_optimizer, make_scaler

    if restore is not None and restore not in SOURCES:
        raise ValueError(f"restore {restore!r} is not one of {', '.join(SOURCES)}")
    source, how = st.extra.get("pending_state"), "carried"
    if source is None:
        how = "seed"
        if restore == "kept" and "kept" in st.extra:
            how = "kept"
        elif restore == "snapshot" and scratch is not None:
            source = latest_snapshot(os.path.join(scratch, "snapshots"))
            how = "snapshot" if source else "seed"
    par = parallelize(st.spec, plan, device=device, fill="seed" if how == "seed" else "none")
    optimizer = make_optimizer(par)
    step = 0
    if how == "kept":
        step = restore_kept(par, optimizer, st.extra.pop("kept"))
    elif source is not None:
        # a re-plan's parts or a snapshot's: written under any plan, each rank reads what its
        # layout needs (DCP resharding where the plan has changed since, checkpoint.load_parts)
        step = load_parts(par, optimizer, source)["step"]
    if how == "carried":
        st.extra.pop("pending_state", None)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every rank has read it
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(source, ignore_errors=True)
    st.extra.pop("kept", None)
    if scratch is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        drop_snapshots_after(os.path.join(scratch, "snapshots"), step)  # a run that no longer continues
    st.parallel, st.model, st.plan, st.mesh = par, par.model, plan, par.mesh
    st.optimizer, st.scaler, st.step = optimizer, make_scaler(plan), step
    return how, step

