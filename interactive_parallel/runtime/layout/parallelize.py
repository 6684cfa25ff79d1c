"""Compose the parallelisms of a Plan onto a model, in one fixed order, torchtitan's way.

Owns the order, nothing else: build on the meta device, pipeline split first (PP), then
within each stage TP -> EP -> CP -> activation recomputation -> compile -> FSDP/replicate, then give the
rank's own modules real storage (`to_empty`) and fill only its local shards
(runtime.layout.initialize: seeded or read from the model's directory), then DDP and the
pipeline schedule, which need real tensors. No rank ever holds a whole copy of a
sharded model. With `materialize=False` the layout stays on meta tensors (no storage,
no DDP, no schedule): the same code answers "what would each rank hold" for a model
far larger than the machine; with `storage=` and `ddp_hook=` the dry run (runtime.client.dryrun)
gives it fake storage and a hook for its fake group, and gets DDP and the schedule as a
live rank does. Each step is one apply_<x> from runtime/parallel/<x>.py on
a mesh from runtime.groups.mesh. Knows nothing of model families (the apply_<x> read
plan.models.FAMILIES), of training, of ipyparallel or of the client. Parallelized, the
handle it returns, is re-exported here.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...plan import MeshAxis, ModelSpec, Plan, mesh_coords
from ..groups.mesh import build_mesh, data_parallel_meshes, tie_group
from ..model.models import build_meta
from ..model.stage import StageModule
from .parallelized import Parallelized

__all__ = ["Parallelized", "parallelize"]

FILLS = ("seed", "none")


def parallelize(spec: ModelSpec, plan: Plan, *, device: torch.device | str = "cpu", materialize: bool = True,
                fill: str = "seed", state_dict: dict | None = None,
                storage: Callable[[Parallelized], None] | None = None,
                ddp_hook: Callable | None = None) -> Parallelized:
    """The model of `spec` laid out under `plan` on this rank.

    fill: 'seed' gives the local shards their values (the plan's seed, or the spec's local
    directory); 'none' leaves the storage uninitialized for a caller that loads a state
    right after (runtime.checkpoints.checkpoint). `state_dict`: full tensors under the transformers
    names to take the local shards from instead (a whole copy in this process: for small
    models and notebooks; re-plans and checkpoints go through runtime.checkpoints.checkpoint).
    `storage`: gives the rank's meta modules their storage in place of `to_empty` and the
    fill (the dry run's FakeTensors); `ddp_hook`: DDP's comm hook in place of the stop-vote
    hook (the dry run's, on a group that moves no bytes). Each parallelism is imported
    where it is applied: tensor parallel and pipelining are slow to import, and plans
    without them need not pay for it.
    """
    if fill not in FILLS:
        raise ValueError(f"fill {fill!r} is not one of {', '.join(FILLS)}")
    if spec.needs_facts:  # a spec from plan.resolve_model alone (tests, scripts): derive here
        from ..model.families import with_facts

        spec = with_facts(spec)
    par, roots = _layout(spec, plan, torch.device(device))
    if not materialize:
        return par
    if storage is not None:  # 6. this rank's shards only
        storage(par)
    else:
        _materialize(par, roots, "none" if state_dict is not None else fill)
    if state_dict is not None:
        from .initialize import init_from_state

        init_from_state(par, state_dict)
    if par.mesh is not None and plan.uses_ddp:  # 7. DDP needs real tensors
        from ..parallel.dp import apply_dp

        par.model = apply_dp(par.raw, par.mesh, axis=MeshAxis.DP.value, device=par.device, comm_hook=ddp_hook)
    if plan.pp > 1:  # 8. the schedule over the (now wrapped) stage modules
        from ..parallel.pp import apply_schedule

        par.schedule, par.schedule_key = apply_schedule(par.stages, plan, par.group(MeshAxis.PP), par.device)
    return par


def _layout(spec: ModelSpec, plan: Plan, device: torch.device) -> tuple[Parallelized, list[nn.Module]]:
    """Steps 1-5 on meta tensors: the rank's layout and the roots that will get storage."""
    raw = build_meta(spec)
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = build_mesh(plan, device.type)
    par = Parallelized(plan=plan, spec=spec, model=raw, raw=raw, mesh=mesh, device=device,
                       coords=dict(mesh_coords(rank, plan.mesh_shape)), aliases=tied_aliases(raw))
    roots: list[nn.Module] = [raw]
    layer_ids = list(range(spec.num_layers))
    if plan.pp > 1:  # 1. pipeline split: this rank's stages
        from ..parallel.pp import apply_pp

        par.stages = apply_pp(raw, spec, plan, par.coords[MeshAxis.PP])
        roots, layer_ids = list(par.stages), [i for s in par.stages for i in s.layer_ids]
    if plan.tp > 1:  # 2. tensor parallel, only the layers this rank holds
        from ..parallel.tp import apply_tp

        par.perms = apply_tp(raw, mesh["tp"], spec, layer_ids, sequence_parallel=plan.sequence_parallel,
                             vocab_split=plan.vocab_split, loss_parallel=plan.loss_parallel, compiled=plan.compile,
                             recomputed=plan.recompute != "none")
    if spec.family_info.experts is not None:  # 2b. experts: routing counted; under ep, split over the ep ranks
        from ..parallel.ep import apply_ep, attach_counter

        from ..groups.mesh import data_group
        from ..model.router_loss import RouterLogits, wanted

        par.routing = attach_counter(raw, spec, plan, layer_ids, rank)
        if wanted(spec):  # the config's load-balancing loss, over the whole batch
            par.router_logits = RouterLogits(raw, spec, layer_ids, data_group(plan, mesh))
        if plan.ep > 1:
            par.expert_params, par.expert_group = apply_ep(raw, spec, plan, layer_ids, device.type)
    if plan.cp > 1:  # 3. context parallel: attention rerouted, the forward takes position ids
        from ..parallel.cp import apply_cp

        apply_cp(raw, mesh["cp"], spec, plan.cp_method)
        par.cp_model = roots[0] = StageModule(raw, spec, layer_ids, True, True)
    if plan.recompute != "none":  # 4. activation recomputation per decoder layer
        from ..parallel.ac import apply_ac

        layers = raw.get_submodule(spec.family_info.layers_path)
        apply_ac([layers[i] for i in layer_ids], plan.recompute)
    if plan.compile:  # 4b. torch.compile each decoder block in place, lazily (after AC, before FSDP)
        from ..parallel.compile import apply_compile

        layers = raw.get_submodule(spec.family_info.layers_path)
        apply_compile([layers[i] for i in layer_ids], plan, experts=spec.family_info.experts is not None)
    par.tie_group = tie_group(plan, spec.tied_embeddings, rank) if mesh is not None else None
    par.model = _apply_sharding(par, roots)  # 5. FSDP / HSDP / replicate, on meta tensors
    return par, roots


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every later name of a parameter registered under several names -> its first name."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(p), name)
        if canonical != name:
            out[name] = canonical
    return out


@contextlib.contextmanager
def _swap_on_conversion():
    """Module._apply swaps tensors in place of assigning new Parameters, so a tied embedding
    and LM head stay one Parameter through `to_empty` (assigned new Parameters, they come
    apart), and FSDP keeps the Parameter objects it registered."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _materialize(par: Parallelized, roots: list[nn.Module], fill: str) -> None:
    from .initialize import init_buffers, init_from_source, init_seeded

    with _swap_on_conversion():
        for root in roots:  # under PP only the stages' modules: the others stay on meta
            root.to_empty(device=par.device)
    if fill == "seed":
        (init_from_source if par.spec.has_weights else init_seeded)(par)
    init_buffers(par, roots)


def _apply_sharding(par: Parallelized, roots: list[nn.Module]) -> nn.Module:
    """Gradient sync over dp, fsdp and cp; returns the module a forward is called on.

    Pure dp gets DDP on the whole model after materializing (runtime.layout.parallelize);
    everything else gets FSDP2 (shard or HSDP mesh) or FSDP2's `replicate` on each root
    (whole model, CP forward or pipeline stage), with its decoder layers as their own
    units, here on meta tensors. With neither, the roots run as they are.
    """
    from ..parallel.dp import apply_replicate
    from ..parallel.fsdp import apply_fsdp

    plan, mesh = par.plan, par.mesh
    if mesh is None or plan.uses_ddp:
        return par.raw
    layers_path = par.spec.family_info.layers_path
    layer_lists = [list(r.layers) if isinstance(r, StageModule) else list(par.raw.get_submodule(layers_path))
                   for r in roots]
    shard_mesh, repl_mesh = data_parallel_meshes(plan, mesh)
    ignored = set(par.expert_params) or None  # their groups are the replicas' (runtime.parallel.ep)
    # Under a pipeline a unit stays gathered from its first microbatch's forward to the step's
    # last backward, as torchtitan keeps it (reshard_after_forward=False when pp is on): one
    # all-gather per unit per micro-step, where resharding after each forward gathered it again
    # for every microbatch (microbatches + 1 gathers, measured). Zero-bubble schedules need it
    # besides: they split a backward into input and weight halves, found from the parameters the
    # stage holds then; resharded after forward, those are the sharded ones, outside the graph, and
    # the last stage's weight gradients came out None or wrong (measured).
    keep_unsharded = plan.pp > 1
    for root, layers in zip(roots, layer_lists):
        if shard_mesh is not None:
            apply_fsdp(root, shard_mesh, layers, precision=plan.precision, ignored=ignored,
                       reshard_after_forward=not keep_unsharded)
        elif repl_mesh is not None:
            apply_replicate(root, repl_mesh, layers, ignored=ignored)
    return nn.ModuleList(roots) if plan.pp > 1 else roots[0]
