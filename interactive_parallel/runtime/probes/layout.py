"""Layout of the parameters on this rank: one ShardRecord per parameter it holds.

Owns turning placements into index ranges. A DTensor parameter's ranges come from its
placements on its DeviceMesh (any number of mesh dims, any tensor rank) via torch's
`compute_local_shape_and_global_offset` (which also knows FSDP's strided shards over a
TP-sharded dim); `local_shape` is what the rank really holds (FSDP's padding excluded).
A plain tensor is the whole tensor, replicated (no placements). Under PP only the
parameters of this rank's stages are listed, each with its stage index. The same record
describes any one tensor held under a parameter's name (`shard_record`: its gradient or an
optimizer state, for Session.fetch), from that tensor's own placements.

Names are the transformers model's parameter names. Does not know the permutation of a
fused q|k|v projection under TP (GPT-2's c_attn): ranges refer to the permuted (sharded)
order the runtime trains in (`Parallelized.perms` maps it back).
"""
from __future__ import annotations

from typing import Any

from ...plan import MESH_ORDER
from ...records import ShardRecord


def _stage_of(par) -> dict[str, int]:
    """Parameter-name prefix -> global stage index, for the stages this rank holds."""
    out: dict[str, int] = {}
    for s in par.stages:
        for prefix in s.owned_prefixes:
            out[prefix] = s.stage_index
    return out


def _where(par) -> tuple[dict[str, int], dict[str, int]]:
    """(this rank's mesh coordinates on the plan's axes of size > 1, its stage per name prefix)."""
    plan = par.plan
    coords = {a.value: int(par.coords.get(a, 0)) for a in MESH_ORDER if getattr(plan, a.value) > 1}
    return coords, _stage_of(par)


def _record(name: str, t, rank: int, coords: dict[str, int], stages: dict[str, int]) -> ShardRecord:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    stage = next((i for prefix, i in stages.items() if name.startswith(prefix)), None)
    shape = list(t.shape)
    common: dict[str, Any] = dict(param=name, rank=rank, global_shape=shape, coords=coords, stage=stage)
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        _, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
        held = list(t._local_tensor.shape)  # FSDP's padding is not held data
        index = [[int(o), int(o) + int(n)] for o, n in zip(offset, held)]
        return ShardRecord(local_shape=held, placements=[repr(x) for x in t.placements],
                           mesh_axes=list(mesh.mesh_dim_names or ()), index=index, **common)
    return ShardRecord(local_shape=shape, placements=[], mesh_axes=[], index=[[0, n] for n in shape], **common)


def shard_records(par, rank: int) -> list[ShardRecord]:
    coords, stages = _where(par)
    owned = set(par.owned_keys())
    return [_record(name, p, rank, coords, stages) for name, p in par.raw.named_parameters() if name in owned]


def shard_record(par, rank: int, name: str, t) -> ShardRecord:
    """The record of one tensor held under parameter `name` on this rank: the parameter itself,
    or its gradient or an optimizer state, each with its own placements (a gradient's may differ)."""
    coords, stages = _where(par)
    return _record(name, t, rank, coords, stages)
