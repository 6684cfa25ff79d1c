"""Analytic estimates: bytes per rank (parameters, gradients, optimizer, activations) and
bytes per collective per step, for a ModelSpec under a Plan, before any rank exists.

Owns the parameter inventory (names, shapes, TP dims), read from the family's entry in
plan.models.FAMILIES (never from its name), and the arithmetic that mirrors what the
runtime does with it: TP shards the linears of the family's tp_plan
(colwise: Linear weight/bias Shard(0), transposed Conv1D weight Shard(1); rowwise: Linear
weight Shard(1), Conv1D weight Shard(0), bias replicated) and replicates norms,
embeddings and the LM head; PP gives each rank its stages (loop order) plus embeddings
(first stage) and norm/head (last stage; a tied head is the embedding, held by both);
FSDP2 shards dim 0 of each (TP-local) tensor with torch.chunk sizes and pads every shard
to the largest one (parameter and gradient storage are padded, AdamW moments are not).
Optimizer: AdamW keeps 2 fp32 moments per element plus one 4-byte `step` per tensor.
Parameters are fp32 under every precision (bf16 is autocast). Activations are
plan.activations' model, re-exported here.

Pure Python: knows no torch. It does not know what the runtime actually allocates beyond
these rules: the measured records (runtime/probes) are the truth, and tests hold these
numbers to them (exactly for params/grads/optimizer, within 10% for activations).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..records import CommEstimate, MemoryRecord
from .activations import predict_activations
from .axes import MeshAxis, mesh_coords
from .models import ModelSpec
from .plan import Plan

__all__ = ["ParamInfo", "param_inventory", "chunk", "owned", "local_tensors", "predict_activations",
           "predict_memory", "predict_comms"]

FP32 = 4


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    """Tensor dim split across tp (None: replicated under tp)."""
    owner: str
    """'embed', 'head' or 'layer' (with `layer` set): decides the pipeline stage."""
    layer: int | None = None


def _tp_dim(style: str | None, leaf: str, transposed: bool) -> int | None:
    """The dim of a block linear's `leaf` ('weight' / 'bias') that TP splits, None if replicated.

    Colwise splits the output features, rowwise the input features; a transposed (Conv1D)
    weight holds them the other way round. A rowwise bias is added after the all-reduce: whole.
    """
    if style is None:
        return None
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    if style.startswith("colwise"):
        return out_dim if leaf == "weight" else 0
    return in_dim if leaf == "weight" else None


def _block_params(spec: ModelSpec) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name relative to a block, shape, tp dim) of every tensor of one decoder block."""
    fam, cfg = spec.family_info, spec.config
    styles = fam.block_tp_styles()
    out: list[tuple[str, tuple[int, ...], int | None]] = []
    for path, lin in fam.linears.items():
        n_in, n_out = spec.width(lin.in_width), spec.width(lin.out_width)
        style = styles.get(path)
        out.append((f"{path}.weight", (n_in, n_out) if fam.weights_transposed else (n_out, n_in),
                    _tp_dim(style, "weight", fam.weights_transposed)))
        if lin.bias if isinstance(lin.bias, bool) else cfg.get(lin.bias, False):
            out.append((f"{path}.bias", (n_out,), _tp_dim(style, "bias", fam.weights_transposed)))
    return out + _norm_params(spec, fam.norm_paths)


def _norm_params(spec: ModelSpec, paths) -> list[tuple[str, tuple[int, ...], None]]:
    leaves = ("weight", "bias") if spec.family_info.norm_bias else ("weight",)
    return [(f"{p}.{leaf}", (spec.hidden_size,), None) for p in paths for leaf in leaves]


def param_inventory(spec: ModelSpec) -> list[ParamInfo]:
    """Every trainable tensor of the model once (a tied head is the embedding, not listed twice)."""
    fam, h, v = spec.family_info, spec.hidden_size, spec.vocab_size
    out = [ParamInfo(f"{fam.embedding_path}.weight", (v, h), None, "embed")]
    if fam.position_embedding_path:
        out.append(ParamInfo(f"{fam.position_embedding_path}.weight", (spec.max_positions, h), None, "embed"))
    block = _block_params(spec)
    for layer in range(spec.num_layers):
        out += [ParamInfo(f"{fam.layers_path}.{layer}.{rel}", shape, dim, "layer", layer) for rel, shape, dim in block]
    out += [ParamInfo(name, shape, None, "head") for name, shape, _ in _norm_params(spec, [fam.final_norm_path])]
    if not spec.tied_embeddings:
        out.append(ParamInfo(f"{fam.lm_head_path}.weight", (v, h), None, "head"))
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
        return p.layer // (spec.num_layers // total) in mine
    if p.owner == "head":
        return total - 1 in mine
    tied_head = spec.tied_embeddings and p.name == f"{spec.family_info.embedding_path}.weight"
    return 0 in mine or (tied_head and total - 1 in mine)


def _shard_group(plan: Plan, coords: dict[MeshAxis, int]) -> tuple[int, int]:
    """(size, index) of this rank's FSDP shard group; cp folds into it under FSDP (runtime rule)."""
    if plan.fsdp == 1:
        return 1, 0
    return plan.fsdp * plan.cp, coords[MeshAxis.FSDP] * plan.cp + coords[MeshAxis.CP]


def local_tensors(spec: ModelSpec, plan: Plan, rank: int) -> list[tuple[ParamInfo, int, int]]:
    """(param, elements held, elements of its storage) for each tensor rank `rank` trains.

    Storage differs from elements only under FSDP, which pads every shard to the largest.
    """
    coords = mesh_coords(rank, plan.mesh_shape)
    f_size, f_index = _shard_group(plan, coords)
    out = []
    for p in param_inventory(spec):
        if not owned(spec, plan, p, coords[MeshAxis.PP]):
            continue
        shape = list(p.shape)
        if p.tp_dim is not None and plan.tp > 1:
            shape[p.tp_dim] = chunk(shape[p.tp_dim], plan.tp, coords[MeshAxis.TP])
        rest = math.prod(shape[1:])
        if f_size > 1:
            held = chunk(shape[0], f_size, f_index) * rest
            storage = -(-shape[0] // f_size) * rest
        else:
            held = storage = math.prod(shape)
        out.append((p, held, storage))
    return out


def predict_memory(spec: ModelSpec, plan: Plan) -> list[MemoryRecord]:
    """One MemoryRecord per rank (step -1: a prediction) of params / grads / optimizer / activations."""
    out = []
    for rank in range(plan.world_size):
        tensors = local_tensors(spec, plan, rank)
        storage = sum(s for _, _, s in tensors) * FP32
        opt = sum(2 * held * FP32 + FP32 for _, held, _ in tensors)
        out.append(MemoryRecord(rank=rank, step=-1, params=storage, grads=storage, optimizer=opt,
                                activations=predict_activations(spec, plan, rank), device=plan.device))
    return out


def _unit_bytes(spec: ModelSpec, plan: Plan, rank: int) -> list[tuple[int, int]]:
    """(held bytes, storage bytes) per FSDP / replicate unit of `rank`: each decoder layer, then the rest."""
    units: dict[object, list[int]] = {}
    for p, held, storage in local_tensors(spec, plan, rank):
        u = units.setdefault(p.layer if p.owner == "layer" else "root", [0, 0])
        u[0] += held * FP32
        u[1] += storage * FP32
    return [tuple(v) for v in units.values()]  # type: ignore[misc]


def predict_comms(spec: ModelSpec, plan: Plan, rank: int = 0) -> list[CommEstimate]:
    """Bytes per optimizer step on `rank`, one CommEstimate per (op, axis).

    Same convention as the comm ledger (runtime/probes/comms.py): an op's bytes are its full
    buffer (all_gather output, reduce_scatter input). What the runtime does, per step:
    DDP (pure dp) all-reduces all gradients once (in buckets: count is None); FSDP2 gathers
    each unit (decoder layer, then the root) in forward and again in backward and
    reduce-scatters its gradients, every micro-step (HSDP then all-reduces the shard over
    dp); `replicate` (dp with tp/pp/cp) all-reduces each unit's gradients; TP all-reduces
    the activations after each rowwise linear (forward) and the input gradient of each
    colwise linear (backward); PP sends activations forward and gradients backward per
    microbatch; CP all-gathers K and V per layer and all-reduces their gradients. Activation
    recomputation repeats the forward collectives it does not save: TP's all-reduces under
    'full', CP's gathers under both modes. Sequence parallel is not modelled (its traffic is
    counted as the plain TP all-reduces).
    """
    coords = mesh_coords(rank, plan.mesh_shape)
    acc, out = plan.grad_accum, []
    rows = plan.batch_size // plan.data_parallel // acc
    act = rows * plan.seq_len // plan.cp * spec.hidden_size * FP32

    def add(op: str, axis: str, count: int | None, nbytes: float) -> None:
        if nbytes > 0:
            out.append(CommEstimate(rank=rank, op=op, axis=axis, count=count, bytes=int(nbytes)))

    units = _unit_bytes(spec, plan, rank)
    f_size, _ = _shard_group(plan, coords)
    if f_size > 1:
        axis = "fsdp_cp" if plan.cp > 1 else "fsdp"
        add("all_gather", axis, 2 * len(units) * acc, 2 * acc * f_size * sum(s for _, s in units))
        add("reduce_scatter", axis, len(units) * acc, acc * f_size * sum(s for _, s in units))
        if plan.dp > 1:
            add("all_reduce", "dp", len(units) * acc, acc * sum(s for _, s in units))
    elif plan.dp > 1 and plan.world_size == plan.dp:
        add("all_reduce", "dp", None, sum(s for _, s in units))
    elif plan.dp * plan.cp > 1:
        axis = "_".join(a for a in ("dp", "cp") if getattr(plan, a) > 1)
        times = 1 if plan.pp > 1 else acc
        add("all_reduce", axis, len(units) * times, times * sum(s for _, s in units))
    layers = len({p.layer for p, _, _ in local_tensors(spec, plan, rank) if p.owner == "layer"})
    if plan.tp > 1:
        styles = list(spec.family_info.tp_plan.values())
        rowwise = sum(1 for s in styles if s == "rowwise")
        # full recomputation runs each layer's forward again in backward, all-reduces included
        per_layer = rowwise * (2 if plan.recompute == "full" else 1) + sum(1 for s in styles if s.startswith("colwise"))
        add("all_reduce", "tp", per_layer * layers * acc, per_layer * layers * acc * act)
    if plan.pp > 1:
        total, mine, m = plan.n_stages, plan.stage_ids(coords[MeshAxis.PP]), plan.n_microbatches
        sends = sum(1 for s in mine if s < total - 1) + sum(1 for s in mine if s > 0)
        add("send", "pp", sends * m * acc, sends * m * acc * act / m)
        add("recv", "pp", sends * m * acc, sends * m * acc * act / m)
    if plan.cp > 1:
        kv = rows * plan.seq_len * spec.num_kv_heads * (spec.hidden_size // spec.num_heads) * FP32 // plan.tp
        # recomputation gathers K and V again (their c10d all_gather is not among the saved ops)
        gathers = 2 * layers * acc * (2 if plan.recompute != "none" else 1)
        add("all_gather", "cp", gathers, gathers * kv)
        add("all_reduce", "cp", (2 * layers + 1) * acc, 2 * layers * acc * kv)
    return out


def parameter_mismatches(model: dict[str, tuple[int, ...]], checkpoint: dict[str, tuple[int, ...]],
                         shown: int = 8) -> list[str]:
    """Lines naming how a checkpoint's tensors (name -> shape) differ from a model's: shapes that
    differ, then the model's tensors it lacks, then tensors the model does not have (`shown`
    of each, then a count); empty when they match."""
    differ = [f"{n}: checkpoint has {list(checkpoint[n])}, model has {list(s)}" for n, s in model.items()
              if n in checkpoint and tuple(checkpoint[n]) != tuple(s)]
    missing = [f"{n}: missing from the checkpoint (model has {list(s)})" for n, s in model.items()
               if n not in checkpoint]
    extra = [f"{n}: in the checkpoint ({list(s)}), not in the model" for n, s in checkpoint.items() if n not in model]
    out: list[str] = []
    for lines, what in ((differ, "with another shape"), (missing, "missing from the checkpoint"),
                        (extra, "not in the model")):
        out += lines[:shown]
        if len(lines) > shown:
            out.append(f"... and {len(lines) - shown} more {what}")
    return out
