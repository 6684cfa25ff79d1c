"""Save and load the full logical model with torch.distributed.checkpoint (DCP), under any plan.

Owns which tensors go into the checkpoint: every rank writes its own shards (DTensor
parameters under TP / FSDP / replicate; only its stages' parameters under PP) under the
transformers names, so a checkpoint written under one plan loads under another, DCP
resharding on load. Weights whose sharded layout is permuted (GPT-2's fused q|k|v under
TP) are stored in the checkpoint layout as full tensors. Knows nothing of optimizers or
of the client: the caller decides what to reset after a load.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from .parallelized import Parallelized


def _logical_state(par: Parallelized) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(state dict to hand to DCP, {name: live parameter} for the permuted entries)."""
    from .parallel.tp import unpermute

    state = par.raw.state_dict()
    out: dict[str, Any] = {}
    live: dict[str, torch.Tensor] = {}
    for name in par.owned_keys():
        t = state[name]
        if name in par.perms:
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[name] = unpermute(full.detach(), *par.perms[name])
            live[name] = t
        else:
            out[name] = t
    return out, live


def save(par: Parallelized, path: str) -> dict[str, Any]:
    """Write the model under `path` (a directory); a collective over all ranks."""
    import torch.distributed.checkpoint as dcp

    os.makedirs(path, exist_ok=True)
    state, _ = _logical_state(par)
    dcp.save(state, checkpoint_id=path)
    return {"path": path, "tensors": len(state), "plan": par.plan.describe()}


def load(par: Parallelized, path: str) -> dict[str, Any]:
    """Read `path` into the current layout in place; a collective over all ranks."""
    import torch.distributed.checkpoint as dcp

    from .parallel.tp import permute

    state, live = _logical_state(par)
    dcp.load(state, checkpoint_id=path)
    with torch.no_grad():
        for name, target in live.items():
            full = permute(state[name], *par.perms[name])
            if hasattr(target, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(local.to_local())
            else:
                target.copy_(full)
    if dist.is_initialized():
        dist.barrier()
    return {"path": path, "tensors": len(state), "plan": par.plan.describe()}
