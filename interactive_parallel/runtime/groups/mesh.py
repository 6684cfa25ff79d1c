"""The DeviceMesh of a plan and the process groups cut from it, cached per process group.

Owns building the mesh over the axes a plan uses (in plan.MESH_ORDER), the cache that
lets a hot re-plan reuse meshes and groups instead of creating fresh gloo groups, which
data-parallel mesh (replicate, shard, or HSDP's 2-D pair) gradients are synchronized
over once dp, fsdp and cp are folded together, and the group of the ranks that hold a
tied embedding and LM head in different pipeline stages. Knows nothing of models or of
how each parallelism uses its mesh: runtime.layout.parallelize hands the meshes to apply_<x>.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from ...plan import MESH_ORDER, MeshAxis, Plan, axis_groups

# Meshes and groups per world group: every hot re-plan would otherwise create fresh gloo
# groups (sockets and threads per member) that nothing frees until the process group dies.
_GROUPS: dict[Any, Any] = {}


def _world_token() -> tuple:
    """What tells one world group from the next in this process (its rendezvous, rank and size)."""
    import os

    return (id(dist.group.WORLD), dist.get_rank(), dist.get_world_size(), os.environ.get("MASTER_ADDR"),
            os.environ.get("MASTER_PORT"))


def forget_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation caches. They key on DeviceMesh equality, which is
    structural (ranks, layout, names), so after a re-formed group they hand new tensors the
    old mesh: its dead process groups (measured: "Could not resolve the process group") and,
    for a renumbered rank, its old coordinates (measured: two ranks writing one shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    meta = getattr(prop, "_propagate_tensor_meta_cached", None)
    if hasattr(meta, "cache_clear"):
        meta.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:
        native()


def cached(key: tuple, make: Callable[[], Any]) -> Any:
    """`make()` once per key and process group (a new world group drops the old, dead ones)."""
    token = _world_token()
    if _GROUPS.get("world") != token:
        if _GROUPS:
            forget_dtensor_caches()
        _GROUPS.clear()
        _GROUPS["world"] = token
    if key not in _GROUPS:
        _GROUPS[key] = make()
    return _GROUPS[key]


def build_mesh(plan: Plan, device_type: str):
    """A DeviceMesh over the axes > 1, in MESH_ORDER (None without a process group or peers).

    Its sub-groups inherit dist.init's timeout: dist.init sets c10d.default_pg_timeout
    first (tests check the sub-groups get it).
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized() or plan.world_size == 1:
        return None
    names = tuple(a.value for a in MESH_ORDER if getattr(plan, a.value) > 1)
    shape = tuple(getattr(plan, n) for n in names)
    return cached(("mesh", device_type, names, shape),
                  lambda: init_device_mesh(device_type, shape, mesh_dim_names=names))


def _flat(mesh, axes):
    """(name, 1-D mesh) of `axes` (a sequence of axis names) folded into one, or (None, None)
    for no axes."""
    if not axes:
        return None, None
    if len(axes) == 1:
        return axes[0], mesh[axes[0]]
    name = "_".join(axes)
    return name, mesh[tuple(axes)]._flatten(name)


def data_group(plan: Plan, mesh):
    """The group of the ranks that see different rows of the batch at this rank's tp and pp
    coordinates (dp, fsdp and cp folded), or None when there are none."""
    if mesh is None:
        return None
    _, flat = _flat(mesh, [a for a in ("dp", "fsdp", "cp") if getattr(plan, a) > 1])
    return flat.get_group() if flat is not None else None


def data_parallel_meshes(plan: Plan, mesh):
    """(shard mesh or None, replicate mesh or None) for gradient sync over plan.gradient_axes
    (which decides the axes: cp folds into fsdp's shard or dp's replicate). With both a shard
    and a replicate axis the shard mesh is 2-D (replicate, shard): HSDP.
    """
    shard, repl = plan.gradient_axes
    shard_name, shard_mesh = _flat(mesh, shard)
    repl_name, repl_mesh = _flat(mesh, repl)
    if shard_mesh is not None and repl_mesh is not None:
        return mesh[(repl_name, shard_name)], None
    return shard_mesh, repl_mesh


def tie_group(plan: Plan, tied: bool, rank: int):
    """Process group of the pipeline ranks holding the first and the last stage, or None.

    Only needed when `tied` (one weight for the embedding and the LM head) and the two
    stages sit on different ranks (not under a V schedule: pipeline rank 0 holds both ends).
    Every rank creates every pair's group, in one order.
    """
    last_owner = plan.stage_owner(plan.n_stages - 1)
    if plan.pp > 1 and tied and last_owner == 0 and plan.dp * plan.fsdp > 1:
        # Checked before any stage is sharded: the two stage roots would each wrap the one
        # weight, and the gradients came out NaN (replicate) or garbage (fully_shard), measured.
        raise ValueError(f"a tied embedding and LM head under pp_schedule {plan.pp_schedule!r} with "
                         f"dp({plan.dp}) * fsdp({plan.fsdp}) = {plan.dp * plan.fsdp} > 1: pipeline rank 0 "
                         "holds both ends of its V, and one weight cannot sit in two FSDP / replicate stage roots")
    if plan.pp == 1 or not tied or last_owner == 0:
        return None
    mine = None
    for ranks in axis_groups(plan.mesh_shape, MeshAxis.PP):
        pair = sorted({ranks[0], ranks[last_owner]})
        group = cached(("tie", tuple(pair)), lambda: dist.new_group(pair))
        if rank in pair:
            mine = group
    return mine
