"""The parameter inventory: every tensor a model trains and the part of it each rank holds.

Owns the names, shapes and TP dims of a model's parameters, read from the family's entry in
plan.models.FAMILIES (never from its name), and the rules that mirror how the runtime lays them
out: TP shards the linears of the family's tp_plan as each style's record says (plan.tp_styles:
colwise: Linear weight/bias Shard(0), transposed Conv1D weight Shard(1); rowwise: Linear weight
Shard(1), Conv1D weight Shard(0), bias replicated) and replicates norms and position embeddings;
the token embedding and the LM head are split on the vocabulary (dim 0 of both; a tied pair is
one tensor, split once) unless the plan keeps them whole (Plan.vocab_split); PP gives each rank its stages
(loop order) plus embeddings (first stage) and norm/head (last stage; a tied head is the embedding,
held by both); FSDP2 shards dim 0 of each (TP-local) tensor with torch.chunk sizes and pads every
shard to the largest one. A mixture-of-experts block's stacked expert weights ([experts, ...], the
family's ExpertsInfo) stay whole under tp; under ep each rank holds its num_experts / ep of them,
kept out of FSDP (runtime.parallel.ep); with ep = 1 they are ordinary parameters, FSDP shards their
dim 0 (the experts) like any other.

The memory model (plan.estimate), the activation model (plan.activations) and the rank
classes of the dry run (plan.virtual) all read it. Pure Python: knows no torch, and nothing
of bytes, optimizers or activations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .axes import MeshAxis, mesh_coords
from .models import ModelSpec
from .plan import Plan
from .tp_styles import TpStyle

__all__ = ["ParamInfo", "param_inventory", "chunk", "owned", "shard_group", "local_tensors", "cut_key", "spec_key", "Memo"]


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    """Tensor dim split across tp (None: replicated under tp)."""
    owner: str
    """'embed', 'head' or 'layer' (with `layer` set): decides the pipeline stage."""
    layer: int | None = None
    expert: bool = False
    """A stacked expert weight (dim 0: the experts), which ep splits."""
    vocab: bool = False
    """The token embedding or LM head weight [vocab, h]: split on dim 0 under Plan.vocab_split."""

    def split_dim(self, plan: Plan) -> int | None:
        """The dim tp splits under `plan` (None: whole on every tp rank)."""
        return 0 if self.vocab and plan.vocab_split else self.tp_dim


def _tp_dim(style: TpStyle | None, leaf: str, transposed: bool) -> int | None:
    """The dim of a block linear's `leaf` ('weight' / 'bias') that TP splits, None if replicated
    (the style's record says which: plan.tp_styles)."""
    if style is None:
        return None
    return style.weight_dim(transposed) if leaf == "weight" else style.bias_dim


def _block_params(spec: ModelSpec) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name relative to a block, shape, tp dim) of every tensor of one decoder block."""
    fam, cfg = spec.family_info, spec.config
    styles = fam.block_tp_records()
    out: list[tuple[str, tuple[int, ...], int | None]] = []
    for path, lin in fam.linears.items():
        n_in, n_out = spec.width(lin.in_width), spec.width(lin.out_width)
        style = styles.get(path)
        out.append((f"{path}.weight", (n_in, n_out) if fam.weights_transposed else (n_out, n_in),
                    _tp_dim(style, "weight", fam.weights_transposed)))
        if lin.bias if isinstance(lin.bias, bool) else cfg.get(lin.bias, False):
            out.append((f"{path}.bias", (n_out,), _tp_dim(style, "bias", fam.weights_transposed)))
    out += [(name, tuple(shape), None) for name, shape in fam.block_params.items()]
    return out + _norm_params(spec, fam.norm_paths)


def _norm_params(spec: ModelSpec, paths) -> list[tuple[str, tuple[int, ...], None]]:
    leaves = ("weight", "bias") if spec.family_info.norm_bias else ("weight",)
    return [(f"{p}.{leaf}", (spec.hidden_size,), None) for p in paths for leaf in leaves]


def param_inventory(spec: ModelSpec) -> list[ParamInfo]:
    """Every trainable tensor of the model once (a tied head is the embedding, not listed twice)."""
    return list(_INVENTORY.get_or_make(spec_key(spec), lambda: tuple(_inventory(spec))))


class Memo(dict):
    """Results kept by key and forgotten all at once past `limit` entries: a plan search asks for
    the same inventory cut, unit bytes or schedule order under many knobs, and a long session
    must not keep every model it ever looked at."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def get_or_make(self, key, make):
        if key not in self:
            if len(self) >= self.limit:
                self.clear()
            self[key] = make()
        return self[key]


_INVENTORY = Memo(64)


def _inventory(spec: ModelSpec) -> list[ParamInfo]:
    fam, h, v = spec.family_info, spec.hidden_size, spec.vocab_size
    out = [ParamInfo(f"{fam.embedding_path}.weight", (v, h), None, "embed", vocab=True)]
    if fam.position_embedding_path:
        out.append(ParamInfo(f"{fam.position_embedding_path}.weight", (spec.max_positions, h), None, "embed"))
    block = _block_params(spec)
    experts = [(f"{fam.experts.experts_path}.{leaf}", (spec.num_experts, *shape))
               for leaf, shape in fam.experts.expert_params.items()] if fam.experts else []
    for layer in range(spec.num_layers):
        out += [ParamInfo(f"{fam.layers_path}.{layer}.{rel}", shape, dim, "layer", layer) for rel, shape, dim in block]
        out += [ParamInfo(f"{fam.layers_path}.{layer}.{rel}", shape, None, "layer", layer, expert=True)
                for rel, shape in experts]
    out += [ParamInfo(name, shape, None, "head") for name, shape, _ in _norm_params(spec, [fam.final_norm_path])]
    if not spec.tied_embeddings:
        out.append(ParamInfo(f"{fam.lm_head_path}.weight", (v, h), None, "head", vocab=True))
    return out


def chunk(n: int, parts: int, index: int) -> int:
    """Length of piece `index` when torch.chunk cuts n into `parts` (ceil-sized, tail may be empty)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def owned(spec: ModelSpec, plan: Plan, p: ParamInfo, pp_rank: int) -> bool:
    if plan.pp == 1:
        return True
    total = plan.n_stages
    mine = plan.stage_ids(pp_rank)
    if p.owner == "layer":
        return plan.layer_stage(spec.num_layers, p.layer) in mine
    if p.owner == "head":
        return total - 1 in mine
    tied_head = spec.tied_embeddings and p.name == f"{spec.family_info.embedding_path}.weight"
    return 0 in mine or (tied_head and total - 1 in mine)


def shard_group(plan: Plan, coords: dict[MeshAxis, int]) -> tuple[int, int]:
    """(size, index) of this rank's FSDP shard group; cp folds into it under FSDP (Plan.gradient_axes)."""
    if plan.fsdp == 1:
        return 1, 0
    return plan.fsdp * plan.cp, coords[MeshAxis.FSDP] * plan.cp + coords[MeshAxis.CP]


def local_tensors(spec: ModelSpec, plan: Plan, rank: int) -> list[tuple[ParamInfo, int, int]]:
    """(param, elements held, elements of its storage) for each tensor rank `rank` trains.

    Storage differs from elements only under FSDP, which pads every shard to the largest. Under
    ep an expert weight holds this rank's experts whole (FSDP does not shard it). Kept per
    (model, what decides the cut, the rank's coordinates): a plan search asks for the same cut
    under many schedules and knobs.
    """
    coords = mesh_coords(rank, plan.mesh_shape)
    return list(_CUT.get_or_make(cut_key(spec, plan, rank), lambda: _cut(spec, plan, coords, *shard_group(plan, coords))))


def cut_key(spec: ModelSpec, plan: Plan, rank: int) -> tuple:
    """What decides local_tensors(spec, plan, rank): the model and the rank's cut of it."""
    coords = mesh_coords(rank, plan.mesh_shape)
    f_size, f_index = shard_group(plan, coords)
    stages = tuple(plan.stage_ids(coords[MeshAxis.PP])) if plan.pp > 1 else ()
    return (spec_key(spec), plan.tp, coords[MeshAxis.TP], f_size, f_index, plan.ep, plan.vocab_split, stages,
            tuple(plan.layer_counts(spec.num_layers)) if plan.pp > 1 else (), plan.n_stages if plan.pp > 1 else 1)


_CUT = Memo(20000)


def spec_key(spec: ModelSpec) -> tuple:
    """A hashable stand-in for the model (its config as text), worked out once per spec object."""
    held = _KEYS.get(id(spec))
    if held is None or held[0] is not spec:
        if len(_KEYS) > 64:
            _KEYS.clear()
        held = _KEYS[id(spec)] = (spec, (spec.name, spec.family, repr(sorted(spec.config.items())), id(spec.facts)))
    return held[1]


_KEYS: dict[int, tuple] = {}
"""id(spec) -> (spec, key): the spec is held so that its id is not reused while cached."""


def _cut(spec: ModelSpec, plan: Plan, coords: dict[MeshAxis, int], f_size: int, f_index: int) -> tuple:
    out = []
    layers = None
    if plan.pp > 1:
        layers = {layer for stage in plan.stage_ids(coords[MeshAxis.PP])
                  for layer in plan.stage_layer_ids(spec.num_layers, stage)}
    for p in param_inventory(spec):
        if p.owner == "layer" and layers is not None:
            if p.layer not in layers:
                continue
        elif not owned(spec, plan, p, coords[MeshAxis.PP]):
            continue
        shape = list(p.shape)
        dim = p.split_dim(plan)
        if dim is not None and plan.tp > 1:
            shape[dim] = chunk(shape[dim], plan.tp, coords[MeshAxis.TP])
        rest = math.prod(shape[1:])
        if p.expert and plan.ep > 1:
            held = storage = shape[0] // plan.ep * rest
        elif f_size > 1:
            held = chunk(shape[0], f_size, f_index) * rest
            storage = -(-shape[0] // f_size) * rest
        else:
            held = storage = math.prod(shape)
        out.append((p, held, storage))
    return tuple(out)
