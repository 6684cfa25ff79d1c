"""Where a new layout's state comes from: the plan's seed, the layout it replaces, shards a rank
kept across a re-formed process group, or the newest snapshot.

Owns building the rank's layout for apply_plan and filling it from one of those sources,
and `keep` / `keep_local`: a rank's own shards of weights and optimizer state, held by reference (no
copy, no collective) while its process group is torn down and formed again, for the
same plan on the same ranks (a failed collective, switching debug mode). Whole copies
never: carried layouts and snapshots go through torch.distributed.checkpoint
(runtime.checkpoints.checkpoint). Knows nothing of the client; the caller says which source.
"""
from __future__ import annotations

import shutil

import torch
import torch.distributed as dist

from ...records import RestoreSource, ScratchLayout
from ..layout.pieces import local_block
from ..rank.state import KeptShards

SOURCES = (RestoreSource.KEPT, RestoreSource.SNAPSHOT)
"""The sources a caller may ask for; the others (seed, carried) follow from what is there."""


def keep_local(st) -> int | None:
    """Keep this rank's own shards in `st` (RankState.kept) before a fresh process group; the
    step they belong to, or None when there is nothing to keep or nothing trustworthy (see
    runtime.api.keep_local)."""
    from ..groups import dist as _dist
    from ..inference.quantize import dequantize
    from ..rank import faults

    st.kept = None
    if st.parallel is None or faults.tainted() or _dist.group_failed():
        return None
    dequantize(st)  # the kept shards are the full-precision weights
    st.kept = keep(st.parallel, st.optimizer, st.step)
    return st.step


def keep(par, optimizer, step: int) -> KeptShards:
    """This rank's local shards (weights, optimizer state) by canonical name, and the step."""
    from ..layout.initialize import owned_parameters

    parts: dict[str, torch.Tensor] = {}
    for name, p in owned_parameters(par).items():
        parts[f"model.{name}"] = local_block(p.detach())[0]
        for field, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                parts[f"optim.{name}.{field}"] = local_block(v)[0]
    return KeptShards(plan=par.plan, rank=dist.get_rank() if dist.is_initialized() else 0, step=step, parts=parts)


@torch.no_grad()
def restore_kept(par, optimizer, kept: KeptShards) -> int:
    """Copy kept shards into a layout of the same plan on the same rank; returns the step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from ..layout.initialize import owned_parameters

    rank = dist.get_rank() if dist.is_initialized() else 0
    if kept.plan != par.plan or kept.rank != rank:
        raise RuntimeError(f"rank {rank}: kept shards belong to plan {kept.plan.describe()} on rank "
                           f"{kept.rank}, not {par.plan.describe()} on rank {rank}")
    parts = kept.parts
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
    return int(kept.step)


def rebuild(st, plan, device, scratch: ScratchLayout | None,
            restore: RestoreSource | None) -> tuple[RestoreSource, int]:
    """Build `plan`'s layout on this rank into `st` and fill it; (where its state came from, step)."""
    from ..layout.parallelize import parallelize
    from ..training.train import make_optimizer, make_scaler

    how, source = _source(st, scratch, restore)
    if plan.compile and scratch is not None:  # the session's, removed at its stop
        from ..parallel.compile import use_cache_dir

        use_cache_dir(scratch.compile_cache)
    par = parallelize(st.spec, plan, device=device, fill="seed" if how == RestoreSource.SEED else "none")
    optimizer = make_optimizer(par)
    step = 0
    if how == RestoreSource.KEPT:
        kept, st.kept = st.kept, None  # taken, even by a restore that fails
        step = restore_kept(par, optimizer, kept)
    elif source is not None:
        from .checkpoint import load_parts

        # a re-plan's parts or a snapshot's: written under any plan, each rank reads what its
        # layout needs (DCP resharding where the plan has changed since, checkpoint.load_parts)
        step = load_parts(par, optimizer, source).step
    if how == RestoreSource.CARRIED:
        st.pending_state = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every rank has read it
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(source, ignore_errors=True)
    st.kept = None
    if scratch is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        from .checkpoint import drop_snapshots_after

        drop_snapshots_after(scratch.snapshots, step)  # a run that no longer continues
    st.parallel, st.model, st.plan, st.mesh = par, par.model, plan, par.mesh
    st.optimizer, st.scaler, st.step = optimizer, make_scaler(plan), step
    return how, step


def check_restore(restore: RestoreSource | None) -> None:
    """Refuse a source a caller may not ask for (ValueError), before anything changes."""
    if restore is not None and restore not in SOURCES:
        raise ValueError(f"restore {str(restore)!r} is not one of {', '.join(SOURCES)}")


def _source(st, scratch: ScratchLayout | None, restore: RestoreSource | None) -> tuple[RestoreSource, str | None]:
    """(where the new layout's state comes from, the directory to read it from, if any): a
    re-plan's pending parts first, else what `restore` asks for when it is there, else the seed."""
    check_restore(restore)
    if st.pending_state is not None:
        return RestoreSource.CARRIED, st.pending_state
    if restore == RestoreSource.KEPT and st.kept is not None:
        return RestoreSource.KEPT, None
    if restore == RestoreSource.SNAPSHOT and scratch is not None:
        from .checkpoint import latest_snapshot

        source = latest_snapshot(scratch.snapshots)
        if source is not None:
            return RestoreSource.SNAPSHOT, source
    return RestoreSource.SEED, None
