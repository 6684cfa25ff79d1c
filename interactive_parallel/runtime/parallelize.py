"""Compose the parallelisms of a Plan onto a model, in one fixed order.

Order: pipeline split first (PP), then within each stage TP -> CP -> FSDP/DP. Weights
are built full on every rank from the seed (or a full state dict) and each parallelism
keeps its own slice without communication, so "materialise" is the build itself: fine
for the models this package trains on CPU; a meta-device build would go here for large
ones. Owns the DeviceMesh for a plan and the Parallelized handle that train/generate
use (which module to call, which slice of the batch is ours, whether this rank sees the
loss, how to gather full weights and gradients). Knows nothing of ipyparallel or of the
client.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..plan import MESH_ORDER, MeshAxis, ModelSpec, Plan, axis_groups, mesh_coords
from .models import build_model
from .parallel.pp import StageModule


@dataclass
class Parallelized:
    """Handles of a model laid out under a plan on this rank."""

    plan: Plan
    spec: ModelSpec
    model: nn.Module
    """The module a forward is called on (DDP/FSDP/TP model; ModuleList of stages under PP)."""
    raw: nn.Module
    """The transformers model underneath the wrappers (same parameters)."""
    mesh: Any = None
    coords: dict = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    stages: list = field(default_factory=list)
    """Pipeline stage modules held by this rank (empty without PP)."""
    schedule: Any = None
    """torch.distributed.pipelining schedule (None without PP)."""
    perms: dict = field(default_factory=dict)
    """Param name -> column permutation of its sharded logical layout (GPT-2 fused qkv under TP)."""
    tie_group: Any = None
    """Ranks holding the tied embedding and LM head in different pipeline stages."""
    cp_model: Any = None
    """Under CP: the whole-model StageModule that takes position ids."""
    schedule_key: tuple = ()
    """The plan knobs the schedule was built for (its stages fix their shapes at first use)."""

    @property
    def data_index(self) -> int:
        """Which slice of the global batch this rank trains on."""
        return self.coords.get(MeshAxis.DP, 0) * self.plan.fsdp + self.coords.get(MeshAxis.FSDP, 0)

    @property
    def data_count(self) -> int:
        return self.plan.data_parallel

    @property
    def sees_loss(self) -> bool:
        """False on pipeline ranks without the last stage: they never hold the logits."""
        return not self.stages or any(s.last for s in self.stages)

    @property
    def has_first(self) -> bool:
        return not self.stages or any(s.first for s in self.stages)

    def group(self, axis: MeshAxis):
        if self.mesh is None or getattr(self.plan, axis.value) == 1:
            return None
        return self.mesh[axis.value].get_group()

    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for p in self.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def forward_logits(self, input_ids: torch.Tensor, attention_mask=None, position_ids=None) -> torch.Tensor:
        """Full-sequence logits on every rank (a collective under PP/TP/FSDP)."""
        if self.schedule is not None:
            from .parallel.pp import pipeline_forward

            return pipeline_forward(self.stages, self.plan, self.group(MeshAxis.PP), input_ids,
                                    self.spec.hidden_size, self.spec.vocab_size,
                                    attention_mask=attention_mask, position_ids=position_ids)
        if self.cp_model is not None:
            from .parallel.cp import whole_sequence

            with whole_sequence():
                return self.cp_model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits

    def _schedule_key(self) -> tuple:
        p = self.plan
        return (p.batch_size // (p.data_parallel * p.grad_accum), p.seq_len, p.n_microbatches, p.grad_accum)

    def refresh_schedule(self) -> None:
        """Rebuild the pipeline schedule if batch, sequence or microbatch knobs changed.

        A PipelineStage keeps the buffer shapes of its first step; running it with other
        shapes aborts the process on gloo (measured), so update_training must not reuse it.
        """
        if self.schedule is None or self._schedule_key() == self.schedule_key:
            return
        from .parallel.pp import build_schedule
        from .train import pipeline_loss

        self.schedule, _ = build_schedule(self.stages, self.plan, self.group(MeshAxis.PP), self.device,
                                          pipeline_loss(self.plan))
        self.schedule_key = self._schedule_key()

    def finish_grads(self) -> None:
        """After backward: sum the tied embedding/head gradient over the stages that hold it."""
        if self.tie_group is None:
            return
        fam = self.spec.family_info
        tied = ([self.raw.get_submodule(fam.embed_paths[0]).weight] if self.has_first else []) + \
               ([self.raw.get_submodule(fam.head_paths[-1]).weight] if self.sees_loss else [])
        for p in {id(p): p for p in tied}.values():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=self.tie_group)

    def owned_keys(self) -> list[str]:
        keys = list(self.raw.state_dict().keys())
        if not self.stages:
            return keys
        prefixes = tuple(p for s in self.stages for p in s.owned_prefixes)
        return [k for k in keys if k.startswith(prefixes)]

    def _gather(self, tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Full CPU tensors under the transformers names, from every layout (a collective)."""
        from .parallel.tp import unpermute

        out = {}
        for name, t in tensors.items():
            if t is None:
                continue
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            full = full.detach().to("cpu", copy=True)
            if name in self.perms:
                full = unpermute(full, self.perms[name])
            out[name] = full
        pp_group = self.group(MeshAxis.PP)
        if pp_group is not None:
            # Each stage owns its keys; every rank needs them all (apply_plan, verify).
            parts: list = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(parts, out, group=pp_group)
            out = {k: v for part in parts for k, v in part.items()}
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer as a full CPU tensor (a collective: every rank must call it)."""
        state = self.raw.state_dict()
        return self._gather({k: state[k] for k in self.owned_keys()})

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients under the parameter names (a collective)."""
        owned = set(self.owned_keys())
        named = {n: p.grad for n, p in self.raw.named_parameters() if n in owned}
        grads = self._gather(named)
        if self.spec.tied_embeddings:
            # One parameter, one gradient: under the embedding's name, as named_parameters()
            # of the plain model gives it (a pipeline or FSDP may have split the pair apart).
            fam = self.spec.family_info
            head = grads.pop(f"{fam.head_paths[-1]}.weight", None)
            if head is not None:
                grads.setdefault(f"{fam.embed_paths[0]}.weight", head)
        return grads


# Meshes and groups per world group: every hot re-plan would otherwise create fresh gloo
# groups (sockets and threads per member) that nothing frees until the process group dies.
_GROUPS: dict[tuple, Any] = {}


def _cached(key: tuple, make):
    if _GROUPS.get("world") is not dist.group.WORLD:  # a new process group: old groups are dead
        _GROUPS.clear()
        _GROUPS["world"] = dist.group.WORLD
    if key not in _GROUPS:
        _GROUPS[key] = make()
    return _GROUPS[key]


def build_mesh(plan: Plan, device_type: str):
    """A DeviceMesh over the axes > 1, in MESH_ORDER; its sub-groups inherit dist.init's timeout
    (dist.init sets c10d.default_pg_timeout first; tests check the sub-groups get it)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized() or plan.world_size == 1:
        return None
    names = tuple(a.value for a in MESH_ORDER if getattr(plan, a.value) > 1)
    shape = tuple(getattr(plan, n) for n in names)
    return _cached(("mesh", device_type, names, shape),
                   lambda: init_device_mesh(device_type, shape, mesh_dim_names=names))


def _dp_meshes(plan: Plan, mesh):
    """(shard mesh or None, replicate mesh or None) for gradient sync over dp, fsdp and cp.

    cp ranks hold the same parameters and see different tokens, so for gradients they are
    data-parallel ranks: folded into the shard axis under FSDP, else the replicate axis.
    """
    shard = [a for a in ("fsdp", "cp") if getattr(plan, a) > 1] if plan.fsdp > 1 else []
    repl = [a for a in ("dp", "cp") if getattr(plan, a) > 1 and a not in shard]

    def flat(axes):
        if not axes:
            return None, None
        if len(axes) == 1:
            return axes[0], mesh[axes[0]]
        name = "_".join(axes)
        return name, mesh[tuple(axes)]._flatten(name)

    shard_name, shard_mesh = flat(shard)
    repl_name, repl_mesh = flat(repl)
    if shard_mesh is not None and repl_mesh is not None:
        return mesh[(repl_name, shard_name)], None  # HSDP: (replicate, shard)
    return shard_mesh, repl_mesh


def _wrap_data_parallel(plan: Plan, mesh, roots: list[nn.Module], layer_lists: list[list[nn.Module]]) -> None:
    from .parallel.dp import apply_replicate
    from .parallel.fsdp import apply_fsdp

    shard_mesh, repl_mesh = _dp_meshes(plan, mesh)
    for root, layers in zip(roots, layer_lists):
        if shard_mesh is not None:
            apply_fsdp(root, shard_mesh, layers, precision=plan.precision)
        elif repl_mesh is not None:
            apply_replicate(root, repl_mesh, layers)


def _tie_group(plan: Plan, spec: ModelSpec, rank: int):
    """Process group of the ranks holding the first and the last stage, for tied embeddings."""
    from .parallel.pp import n_stages

    if plan.pp == 1 or not spec.tied_embeddings:
        return None
    last_owner = (n_stages(plan) - 1) % plan.pp
    mine = None
    for ranks in axis_groups(plan.mesh_shape, MeshAxis.PP):
        pair = sorted({ranks[0], ranks[last_owner]})
        # every rank creates every group, in the same order
        g = _cached(("tie", tuple(pair)), lambda: dist.new_group(pair))
        if rank in pair:
            mine = g
    return mine


def parallelize(spec: ModelSpec, plan: Plan, *, state_dict: dict | None = None,
                device: torch.device | str = "cpu") -> Parallelized:
    """The model of `spec` laid out under `plan` on this rank, weights from `state_dict`
    (full tensors) or from the plan's seed."""
    device = torch.device(device)
    raw = build_model(spec, seed=plan.seed, device="cpu")
    if state_dict is not None:
        raw.load_state_dict(state_dict)
    raw.to(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    coords = dict(mesh_coords(rank, plan.mesh_shape))
    mesh = build_mesh(plan, device.type)
    par = Parallelized(plan=plan, spec=spec, model=raw, raw=raw, mesh=mesh, coords=coords, device=device)
    if mesh is None:
        return par
    _layout(par, rank)
    return par


def _layout(par: Parallelized, rank: int) -> None:
    plan, spec, raw, mesh = par.plan, par.spec, par.raw, par.mesh
    from .parallel.pp import split_stages

    if plan.pp > 1:  # 1. pipeline split
        par.stages = split_stages(raw, spec, plan, par.coords[MeshAxis.PP])
        roots = list(par.stages)
        layer_ids = [i for s in par.stages for i in s.layer_ids]
    else:
        roots = [raw]
        layer_ids = list(range(spec.num_layers))
    if plan.tp > 1:  # 2. tensor parallel, only the layers this rank holds
        from .parallel.tp import apply_tp

        par.perms = apply_tp(raw, mesh["tp"], spec, layer_ids, sequence_parallel=plan.sequence_parallel)
    if plan.cp > 1:  # 3. context parallel: attention swapped, forward through position ids
        from .parallel.cp import apply_cp

        apply_cp(raw, mesh["cp"], spec)
        par.cp_model = roots[0] = StageModule(raw, spec, layer_ids, True, True)
    par.tie_group = _tie_group(plan, spec, rank)
    layers_of = [list(r.layers) if isinstance(r, StageModule) else
                 list(raw.get_submodule(spec.family_info.layers_path)) for r in roots]
    if plan.dp > 1 and plan.world_size == plan.dp:  # 4. pure dp: DDP
        from .parallel.dp import apply_dp

        par.model = apply_dp(raw, mesh, axis=MeshAxis.DP.value, device=par.device)
    else:  # 4. FSDP / HSDP / replicate over dp, fsdp and cp
        _wrap_data_parallel(plan, mesh, roots, layers_of)
        par.model = nn.ModuleList(roots) if plan.pp > 1 else roots[0]
    if plan.pp > 1:  # 5. the schedule over the (now wrapped) stage modules
        from .parallel.pp import build_schedule
        from .train import pipeline_loss

        par.schedule, _ = build_schedule(par.stages, plan, par.group(MeshAxis.PP), par.device, pipeline_loss(plan))
        par.schedule_key = par._schedule_key()
