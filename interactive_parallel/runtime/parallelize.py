"""Compose the parallelisms of a Plan onto a model, in one fixed order.

Owns the order, nothing else: pipeline split first (PP), then within each stage TP ->
CP -> FSDP/DP, then the pipeline schedule over the wrapped stages; each step is one
apply_<x> from runtime/parallel/<x>.py on a mesh from runtime.mesh. Weights are built
full on every rank from the seed (or a full state dict) and each parallelism keeps its
own slice without communication, so "materialise" is the build itself: fine for the
models this package trains on CPU; a meta-device build would go here for large ones.
Knows nothing of model families (the apply_<x> read plan.models.FAMILIES), of training,
of ipyparallel or of the client. Parallelized, the handle it returns, is re-exported here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..plan import MeshAxis, ModelSpec, Plan, mesh_coords
from .mesh import build_mesh, data_parallel_meshes, tie_group
from .models import build_model
from .parallel.pp import StageModule
from .parallelized import Parallelized

__all__ = ["Parallelized", "parallelize"]


def parallelize(spec: ModelSpec, plan: Plan, *, state_dict: dict | None = None,
                device: torch.device | str = "cpu") -> Parallelized:
    """The model of `spec` laid out under `plan` on this rank, weights from `state_dict`
    (full tensors) or from the plan's seed.

    Each parallelism is imported where it is applied: tensor parallel and pipelining cost
    ~0.5 s each to import (measured), which plans without them need not pay.
    """
    device = torch.device(device)
    raw = build_model(spec, seed=plan.seed, device="cpu")
    if state_dict is not None:
        raw.load_state_dict(state_dict)
    raw.to(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = build_mesh(plan, device.type)
    par = Parallelized(plan=plan, spec=spec, model=raw, raw=raw, mesh=mesh, device=device,
                       coords=dict(mesh_coords(rank, plan.mesh_shape)))
    if mesh is None:
        return par
    roots: list[nn.Module] = [raw]
    layer_ids = list(range(spec.num_layers))
    if plan.pp > 1:  # 1. pipeline split: this rank's stages
        from .parallel.pp import apply_pp

        par.stages = apply_pp(raw, spec, plan, par.coords[MeshAxis.PP])
        roots, layer_ids = list(par.stages), [i for s in par.stages for i in s.layer_ids]
    if plan.tp > 1:  # 2. tensor parallel, only the layers this rank holds
        from .parallel.tp import apply_tp

        par.perms = apply_tp(raw, mesh["tp"], spec, layer_ids, sequence_parallel=plan.sequence_parallel)
    if plan.cp > 1:  # 3. context parallel: attention rerouted, the forward takes position ids
        from .parallel.cp import apply_cp

        apply_cp(raw, mesh["cp"], spec)
        par.cp_model = roots[0] = StageModule(raw, spec, layer_ids, True, True)
    par.tie_group = tie_group(plan, spec.tied_embeddings, rank)
    par.model = _apply_data_parallel(par, roots)  # 4. FSDP / HSDP / DDP / replicate
    if plan.pp > 1:  # 5. the schedule over the (now wrapped) stage modules
        from .parallel.pp import apply_schedule

        par.schedule, par.schedule_key = apply_schedule(par.stages, plan, par.group(MeshAxis.PP), device)
    return par


def _apply_data_parallel(par: Parallelized, roots: list[nn.Module]) -> nn.Module:
    """Gradient sync over dp, fsdp and cp; returns the module a forward is called on.

    Pure dp gets DDP on the whole model; everything else gets FSDP2 (shard or HSDP mesh)
    or FSDP2's `replicate` on each root (whole model, CP forward or pipeline stage), with
    its decoder layers as their own units. With neither, the roots run as they are.
    """
    from .parallel.dp import apply_dp, apply_replicate
    from .parallel.fsdp import apply_fsdp

    plan, mesh = par.plan, par.mesh
    if plan.dp > 1 and plan.world_size == plan.dp:
        return apply_dp(par.raw, mesh, axis=MeshAxis.DP.value, device=par.device)
    layers_path = par.spec.family_info.layers_path
    layer_lists = [list(r.layers) if isinstance(r, StageModule) else list(par.raw.get_submodule(layers_path))
                   for r in roots]
    shard_mesh, repl_mesh = data_parallel_meshes(plan, mesh)
    for root, layers in zip(roots, layer_lists):
        if shard_mesh is not None:
            apply_fsdp(root, shard_mesh, layers, precision=plan.precision)
        elif repl_mesh is not None:
            apply_replicate(root, repl_mesh, layers)
    return nn.ModuleList(roots) if plan.pp > 1 else roots[0]
