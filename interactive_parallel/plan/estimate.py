"""Analytic estimates: bytes per rank (parameters, gradients, optimizer, activations) and
bytes per collective per step, for a ModelSpec under a Plan, before any rank exists.

Owns the bytes: what each rank holds comes from plan.inventory (the parameter inventory
and the TP / PP / FSDP rules that cut it, re-exported here), and this module turns it into
storage and traffic. FSDP pads parameter and gradient storage to the largest shard, AdamW
moments are not padded. Optimizer: AdamW keeps 2 fp32 moments per element plus one 4-byte
`step` per tensor. Parameters are fp32 under every precision (bf16 is autocast).
Activations are plan.activations' model (its peak plan.activation_peak's), re-exported here.

Pure Python: knows no torch. It does not know what the runtime actually allocates beyond
these rules: the measured records (runtime/probes) are the truth, and tests hold these
numbers to them (exactly for params/grads/optimizer, within 10% for activations).
"""
from __future__ import annotations

from ..records import CommEstimate, MemoryRecord
from .activation_peak import predict_activations
from .activations import INT64, act_bytes, micro_rows, stream_bytes
from .axes import MeshAxis, mesh_coords
from .inventory import Memo, ParamInfo, chunk, cut_key, local_tensors, owned, param_inventory, shard_group
from .models import ModelSpec
from .plan import Plan
from .tp_styles import tp_style

__all__ = ["ParamInfo", "param_inventory", "chunk", "owned", "shard_group", "local_tensors", "predict_activations",
           "predict_memory", "predict_comms", "clip_comms", "gathered_bytes", "rank_peak"]

FP32 = 4


def predict_memory(spec: ModelSpec, plan: Plan, ranks: list[int] | None = None) -> list[MemoryRecord]:
    """One MemoryRecord per rank (step -1: a prediction) of params / grads / optimizer / activations
    (of `ranks` only, when given: a search over a thousand ranks asks for one per stage)."""
    out = []
    for rank in range(plan.world_size) if ranks is None else ranks:
        tensors = local_tensors(spec, plan, rank)
        storage = sum(s for _, _, s in tensors) * FP32
        opt = sum(2 * held * FP32 + FP32 for _, held, _ in tensors)
        out.append(MemoryRecord(rank=rank, step=-1, params=storage, grads=storage, optimizer=opt,
                                activations=predict_activations(spec, plan, rank), device=plan.device))
    return out


def gathered_bytes(spec: ModelSpec, plan: Plan, rank: int) -> int:
    """Bytes of FSDP-gathered weights `rank` holds beside its shards at its peak, which the memory
    records leave out (the probe counts a parameter's storage once, not the copies FSDP gathers):
    under a pipeline every unit of its stages stays gathered from the step's first forward to its
    last backward (runtime.layout.parallelize, as torchtitan). Elsewhere FSDP holds one or two
    units gathered at a time, not counted."""
    if plan.pp == 1 or not plan.gradient_axes[0]:
        return 0
    return _gathered_once(spec, plan, rank)


def rank_peak(spec: ModelSpec, plan: Plan, memory: MemoryRecord) -> int:
    """A rank's predicted peak bytes: its predicted memory record's parts (predict_memory) and the
    gathered weights beside them (gathered_bytes). What the fit check, the step-time model and
    the plan search compare with a machine's memory."""
    return memory.params + memory.grads + memory.optimizer + memory.activations + gathered_bytes(spec, plan, memory.rank)


def _gathered_once(spec: ModelSpec, plan: Plan, rank: int) -> int:
    """Bytes of every FSDP unit of `rank` gathered whole once: its shard group's storage, in the
    units' compute dtype (bf16 gathers move half the fp32 shards' bytes: fsdp.mixed_precision)."""
    f_size, _ = shard_group(plan, mesh_coords(rank, plan.mesh_shape))
    return f_size * sum(storage for _, storage in _unit_bytes(spec, plan, rank)) * stream_bytes(plan) // FP32


def _unit_bytes(spec: ModelSpec, plan: Plan, rank: int) -> list[tuple[int, int]]:
    """(held bytes, storage bytes) per FSDP / replicate unit of `rank`: each decoder layer, then the rest
    (under ep without the expert weights, which neither FSDP nor replicate holds)."""
    return _UNITS.get_or_make(cut_key(spec, plan, rank), lambda: _units(spec, plan, rank))


_UNITS = Memo(20000)


def _units(spec: ModelSpec, plan: Plan, rank: int) -> list[tuple[int, int]]:
    units: dict[object, list[int]] = {}
    stages = plan.stage_ids(mesh_coords(rank, plan.mesh_shape)[MeshAxis.PP]) if plan.pp > 1 else [0]
    for p, held, storage in local_tensors(spec, plan, rank):
        if p.expert and plan.ep > 1:
            continue
        if p.owner == "layer":
            key: object = p.layer
        elif plan.pp == 1:
            key = "root"
        else:
            # Under a pipeline each stage module is a root unit of its own: a V schedule's rank
            # holds the first stage's embedding and the last stage's norm and head in two.
            key = ("root", 0 if p.owner == "embed" and 0 in stages else plan.n_stages - 1)
        u = units.setdefault(key, [0, 0])
        u[0] += held * FP32
        u[1] += storage * FP32
    return [tuple(v) for v in units.values()]  # type: ignore[misc]


def predict_comms(spec: ModelSpec, plan: Plan, rank: int = 0) -> list[CommEstimate]:
    """Bytes per optimizer step on `rank`, one CommEstimate per (op, axis).

    Same convention as the comm ledger (runtime/probes/ledger.py): an op's bytes are its full
    buffer (all_gather output, reduce_scatter input). What the runtime does, per step:
    DDP (pure dp) all-reduces all gradients once (in buckets: count is None); FSDP2 gathers
    each unit (decoder layer, then the root; a pipeline stage's root its own unit) in forward and
    again in backward, once under a pipeline (_gathers_per_unit), and reduce-scatters its
    gradients, every micro-step (HSDP then all-reduces the shard over dp); `replicate` (dp with
    tp/pp/cp) all-reduces each unit's gradients; TP all-reduces
    the activations after each rowwise linear (forward) and the input gradient of each
    colwise linear (backward); PP sends activations forward and gradients backward per
    microbatch; CP all-gathers K and V per layer and all-reduces their gradients (ring CP sends
    them, and their gradients, one block per hop to the next cp rank instead). Activation
    recomputation repeats the forward collectives it does not save: TP's all-reduces under
    'full' but a block's last (its output is needed by no backward; measured: torch's checkpoint
    stops early), CP's gathers under both modes. Each TP all-reduce moves its tensor's dtype:
    under autocast the rowwise outputs in the compute dtype, the input gradients in the residual
    stream's (fp32; bf16 where FSDP gathers bf16 parameters, Plan.gathers_bf16, which also halves
    its all-gathers and the pipeline's sends; gradients are reduced in fp32).
    Sequence parallel is not modelled (its traffic is counted as the plain TP all-reduces). The
    vocabulary-split ends (Plan.vocab_split) add the embedding's output all-reduce, the head's
    input-gradient all-reduce and the all-gather of its logits, or under loss parallel its
    cross-entropy's three per-token all-reduces instead of the gather. Expert parallelism: see
    _expert_comms; gradient clipping's norm all-reduces: see clip_comms.
    """
    coords = mesh_coords(rank, plan.mesh_shape)
    rows = plan.batch_size // plan.data_parallel // plan.grad_accum  # one micro-step's rows on this rank
    act = rows * plan.seq_len // plan.cp * spec.hidden_size * FP32
    layers = len({p.layer for p, _, _ in local_tensors(spec, plan, rank) if p.owner == "layer"})
    parts = (_gradient_comms(spec, plan, rank, coords) + _tp_comms(spec, plan, coords, layers, act) +
             _pp_comms(plan, coords, act) + _cp_comms(spec, plan, layers, rows) +
             _expert_comms(spec, plan, rank, layers) + clip_comms(spec, plan, rank))
    merged: dict[tuple[str, str], tuple[int | None, float]] = {}
    for op, axis, count, nbytes in parts:  # the clip's all-reduces join the same axis's others
        if nbytes <= 0:
            continue
        before = merged.get((op, axis))
        merged[op, axis] = (count, nbytes) if before is None else (
            None if before[0] is None or count is None else before[0] + count, before[1] + nbytes)
    return [CommEstimate(rank=rank, op=op, axis=axis, count=count, bytes=int(nbytes))
            for (op, axis), (count, nbytes) in merged.items()]


def clip_comms(spec: ModelSpec, plan: Plan, rank: int = 0) -> Comms:
    """Gradient clipping's collectives per step (Plan.max_grad_norm; runtime.training.clip): the
    total norm's all-reduces of per-tensor norms, one fp32 value per gradient.

    torch takes a sharded gradient's norm per tensor and sums a group's squares over each mesh
    dim the group is split on with one all-reduce of the group's norms (a vector): groups are
    the gradients of one mesh and one placement. Under FSDP every gradient is sharded on the FSDP
    axis, in four groups as tp leaves them (measured on the ledger): split by tp on dim 0 (FSDP's
    strided shard of the same dim), split by tp on another dim, whole on every tp rank as a
    replicated DTensor (a rowwise bias, a norm under sequence parallelism, Qwen3's head norms),
    and plain (a norm or a whole vocabulary end, FSDP's 1-D mesh); those split by tp also
    all-reduce over tp. Without FSDP only the tp-split gradients cost anything: one tp all-reduce.
    A pipeline sums the stages' squares with one all-reduce of a scalar. A tied weight's second
    copy (the head on a later stage than the embedding) is left out of the norm."""
    if not plan.max_grad_norm:
        return []
    coords = mesh_coords(rank, plan.mesh_shape)
    fam = spec.family_info
    stages = plan.stage_ids(coords[MeshAxis.PP]) if plan.pp > 1 else [0]
    tied_copy = f"{fam.embedding_path}.weight" if spec.tied_embeddings and 0 not in stages else None
    sharded = "_".join(plan.gradient_axes[0])
    groups: dict[str, int] = {}
    for p, _, _ in local_tensors(spec, plan, rank):
        if p.name == tied_copy:
            continue
        split = p.split_dim(plan) if plan.tp > 1 else None
        if split is not None:  # under FSDP a strided shard of tp's dim 0 is a placement of its own
            key = "split on dim 0" if split == 0 and sharded else "split"
        elif plan.tp > 1 and _tp_replicated(spec, plan, p):
            key = "replicated on tp"
        else:
            key = "plain"
        groups[key] = groups.get(key, 0) + 1
    out: Comms = []
    split_groups = [n for key, n in groups.items() if key.startswith("split")]
    if sharded:
        out.append(("all_reduce", sharded, len(groups), FP32 * sum(groups.values())))
    if split_groups:
        out.append(("all_reduce", "tp", len(split_groups), FP32 * sum(split_groups)))
    if plan.pp > 1:
        out.append(("all_reduce", "pp", 1, FP32))
    return out


def _tp_replicated(spec: ModelSpec, plan: Plan, p: ParamInfo) -> bool:
    """Whether tp holds `p` whole on every tp rank as a replicated DTensor (not a plain tensor):
    a parameter of a block module tp lays out (a rowwise linear's bias), a block's norm under
    sequence parallelism, a block parameter outside the linears and norms (Qwen3's head norms)."""
    fam = spec.family_info
    if p.owner != "layer" or p.expert:
        return False
    rel = p.name[len(f"{fam.layers_path}.{p.layer}."):]
    module = rel.rsplit(".", 1)[0]
    if module in fam.norm_paths:
        return plan.sequence_parallel
    return module in fam.block_tp_styles() or rel in fam.block_params


Comms = list[tuple[str, str, "int | None", float]]
"""(op, axis, calls or None for DDP's buckets, bytes) per step, as predict_comms gathers them."""


def _gradient_comms(spec: ModelSpec, plan: Plan, rank: int, coords: dict[MeshAxis, int]) -> Comms:
    """The gradients' averaging over Plan.gradient_axes: FSDP's gathers and reduce-scatters per
    unit and micro-step (and HSDP's all-reduce across replicas), DDP's bucketed all-reduce, or
    replicate's all-reduce per unit (once per step under a pipeline, which accumulates)."""
    acc = plan.grad_accum
    units = _unit_bytes(spec, plan, rank)
    shards = sum(s for _, s in units)
    sharded, replicated = plan.gradient_axes
    if sharded:
        f_size, _ = shard_group(plan, coords)
        axis = "_".join(sharded)
        gathers = _gathers_per_unit(plan)  # gradients are reduced in fp32 whatever is gathered
        out: Comms = [("all_gather", axis, gathers * len(units) * acc, gathers * acc * _gathered_once(spec, plan, rank)),
                      ("reduce_scatter", axis, len(units) * acc, acc * f_size * shards)]
        if replicated:  # HSDP: the shards' owners average across the replicas
            out.append(("all_reduce", "_".join(replicated), len(units) * acc, acc * shards))
        return out
    if plan.uses_ddp:
        return [("all_reduce", "dp", None, shards)]
    if replicated:
        times = 1 if plan.pp > 1 else acc
        return [("all_reduce", "_".join(replicated), len(units) * times, times * shards)]
    return []


def _gathers_per_unit(plan: Plan) -> int:
    """All-gathers of one FSDP unit per micro-step: its forward, then its backward (resharded after
    forward); under a pipeline one, the unit kept gathered from its first microbatch's forward to
    the last backward (runtime.layout.parallelize, as torchtitan). The reduce-scatter is one per
    unit per micro-step either way."""
    return 1 if plan.pp > 1 else 2


def _tp_comms(spec: ModelSpec, plan: Plan, coords: dict[MeshAxis, int], layers: int, act: int) -> Comms:
    """TP's all-reduces: after each rowwise linear (forward, again under full recomputation but the
    block's last) and of each colwise linear's input gradient (backward), per microbatch; the
    vocabulary ends' two, and the head's logits gather (or loss parallel's three)."""
    if plan.tp == 1:
        return []
    styles = [tp_style(s) for s in spec.family_info.tp_plan.values()]
    rowwise = sum(1 for s in styles if s.reduces_output)
    # A fully recomputed block runs its forward again up to the last tensor its backward needs
    # (torch's checkpoint stops early): the last rowwise output only feeds the residual add.
    forward = rowwise + (max(rowwise - 1, 0) if plan.recompute == "full" else 0)
    backward = sum(1 for s in styles if s.reduces_input_grad)
    per_layer = forward + backward
    # Under autocast a rowwise linear's output is in its compute dtype, while a colwise linear's
    # input (a norm's output) and so its gradient are in the residual stream's: fp32, or bf16
    # where FSDP gathers bf16 parameters.
    stream = stream_bytes(plan)
    layer_bytes = (forward * act_bytes(plan) + backward * stream) * (act // FP32)
    # The vocabulary-split ends (Plan.vocab_split): the embedding's output (forward, first stage)
    # and the colwise head's input gradient (backward, last stage), once per microbatch, in the
    # stream's dtype; the head's logits all-gathered in their compute dtype for the plain loss, or
    # under loss parallel torch's cross-entropy all-reduces three fp32 values per token (the
    # logits' max, the sum of their exponentials, the target's logit) inside DTensor's dispatch,
    # which the comm ledger sees too.
    stages = plan.stage_ids(coords[MeshAxis.PP]) if plan.pp > 1 else [0]
    last = plan.vocab_split and (plan.n_stages - 1 in stages or plan.pp == 1)
    ends = (0 in stages) + last if plan.vocab_split else 0
    m = plan.n_microbatches if plan.pp > 1 else 1
    acc = plan.grad_accum
    calls, nbytes = (per_layer * layers + ends) * m * acc, (layer_bytes * layers + ends * act // FP32 * stream) * acc
    tokens = act // (FP32 * spec.hidden_size)
    if last and plan.loss_parallel:
        calls, nbytes = calls + 3 * m * acc, nbytes + 3 * acc * tokens * FP32
    out: Comms = [("all_reduce", "tp", calls, nbytes)]
    if last and not plan.loss_parallel:
        out.append(("all_gather", "tp", m * acc, acc * tokens * spec.vocab_size * act_bytes(plan)))
    return out


def _pp_comms(plan: Plan, coords: dict[MeshAxis, int], act: int) -> Comms:
    """The pipeline's sends and receives: a microbatch's activations (or their gradient) per hop
    between stages on different ranks."""
    if plan.pp == 1:
        return []
    total, pp_rank, m, acc = plan.n_stages, coords[MeshAxis.PP], plan.n_microbatches, plan.grad_accum
    mine = plan.stage_ids(pp_rank)
    # A neighbour stage on this same rank (the turn of a V schedule) is handed over, not sent.
    sends = sum(1 for s in mine if s < total - 1 and plan.stage_owner(s + 1) != pp_rank) + \
        sum(1 for s in mine if s > 0 and plan.stage_owner(s - 1) != pp_rank)
    nbytes = sends * acc * act // FP32 * stream_bytes(plan)  # the residual stream's dtype
    return [("send", "pp", sends * m * acc, nbytes), ("recv", "pp", sends * m * acc, nbytes)]


def _cp_comms(spec: ModelSpec, plan: Plan, layers: int, rows: int) -> Comms:
    """CP's K and V per layer: all-gathered and their gradients all-reduced, or (ring) one block
    per hop to the next cp rank and the gradients back."""
    if plan.cp == 1:
        return []
    acc = plan.grad_accum
    kv = rows * plan.seq_len * spec.num_kv_heads * (spec.hidden_size // spec.num_heads) * FP32 // plan.tp
    if plan.cp_method == "ring":
        block = 2 * kv // plan.cp  # K and V of this rank's tokens, packed (dK|dV travel in fp32 too)
        # forward cp-1 hops (again under recomputation); backward cp-1 K|V hops and cp dK|dV hops
        hops = layers * acc * ((plan.cp - 1) * (2 if plan.recompute != "none" else 1) + (plan.cp - 1) + plan.cp)
        return [("send", "cp", hops, hops * block), ("recv", "cp", hops, hops * block)]
    # recomputation gathers K and V again (their c10d all_gather is not among the saved ops)
    gathers = 2 * layers * acc * (2 if plan.recompute != "none" else 1)
    return [("all_gather", "cp", gathers, gathers * kv), ("all_reduce", "cp", (2 * layers + 1) * acc, 2 * layers * acc * kv)]


def _expert_comms(spec: ModelSpec, plan: Plan, rank: int, layers: int) -> Comms:
    """(op, axis, count, bytes) per step of expert parallelism on `rank` holding `layers` MoE layers,
    at uniform routing (each rank's experts receive as many (token, slot) pairs as it sends).

    Per MoE layer and forward (runtime.parallel.ep, transformers' AllToAllEP) on the ep group:
    one all_to_all of the per-expert counts (int64, num_experts), the dispatch of this rank's
    pairs (its tokens, its 1/tp slice under tp, times top_k, x hidden, fp32: the experts compute
    in their fp32 weights' dtype under autocast too) and the combine of as many back; backward
    runs the two token all-to-alls in reverse. Recomputation (either mode: all_to_all is not
    among the saved ops) repeats the forward ones. Under tp the output is all-gathered over tp
    (forward) and so are the row gradients of the input and of the top-k weights (backward).
    After backward one all_reduce of the flat expert gradients over the replica group (the ranks
    holding the same experts: the expert replicas times tp), when it has more than one rank.
    """
    if plan.ep <= 1 or spec.family_info.experts is None or not layers:
        return []
    forwards = plan.grad_accum * (plan.n_microbatches if plan.pp > 1 else 1)
    again = 2 if plan.recompute != "none" else 1
    tokens = micro_rows(plan) * plan.seq_len // plan.cp
    pairs = tokens // plan.tp * spec.experts_per_token
    h = spec.hidden_size
    passes = layers * forwards
    out = [("all_to_all", "ep", passes * (3 * again + 2),
            passes * (again * (spec.num_experts * INT64 + 2 * pairs * h * FP32) + 2 * pairs * h * FP32))]
    if plan.tp > 1:
        fwd = 2 if plan.recompute == "full" else 1
        out.append(("all_gather", "tp", passes * (fwd + 2),
                    passes * (fwd * tokens * h + tokens * (h + spec.experts_per_token)) * FP32))
    if plan.expert_replicas * plan.tp > 1:
        grads = sum(held for p, held, _ in local_tensors(spec, plan, rank) if p.expert) * FP32
        out.append(("all_reduce", "ep_replica", 1, grads))
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
