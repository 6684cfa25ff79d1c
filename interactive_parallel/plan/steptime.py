"""The step-time model: how long one optimizer step of a plan takes on a hardware profile.

Owns the seconds, per rank: compute (the FLOPs of every block's linears and attention, of the
experts a token is routed to, of the head, counted from the same parameter inventory as the
memory model (plan.inventory: tensor-parallel shards included), over the profile's FLOP rate,
plus the fixed cost of every operation and the bytes elementwise work and the optimizer stream,
plus a pipeline schedule's own cost per action, plus the profile's fixed costs per step: the
loop's, and a replicated wrapper's where DDP or replicate averages the gradients),
communication (every collective plan.estimate.predict_comms lists: latency x count + bytes x
the collective's ring factor / the link's bandwidth, the link chosen per mesh axis by whether
its group spans hosts), the pipeline bubble (the schedule's own order of forwards, backwards
and weight halves replayed by plan.pipeline_time with each action's duration and the
point-to-point transfer between stages), and what overlaps what (DDP's buckets with backward,
FSDP2's prefetch, to the profile's `overlap`). Tensor, context and expert parallel collectives
sit inside the forwards and backwards that wait for them.

Model FLOPs for MFU: 6 x the parameters a token passes through (non-embedding, the head
included; an MoE layer's routed experts only) + causal attention's 6 x layers x seq x width,
no recomputation. Operation counts per block are aten operations of a transformers decoder
block (forward, backward) and of AdamW per tensor, counted once with a TorchDispatchMode:
structure, not timing. Not modelled: sequence parallel's different collectives (counted as
the plain TP all-reduces, as predict_comms does), data loading, the optimizer of frozen
weights, kernel fusion by torch.compile. Pure Python: knows no torch.
"""
from __future__ import annotations

import math

from ..records import CommEstimate, HardwareProfile, StepPrediction
from .activations import layer_parts, micro_rows, stream_bytes
from .axes import MESH_ORDER, MeshAxis, mesh_coords, mesh_rank
from .estimate import predict_comms, predict_memory, rank_peak
from .inventory import Memo, local_tensors, param_inventory, spec_key
from .models import ModelSpec
from .pipeline_time import ActionCost, core_speed, simulate
from .plan import Plan

BLOCK_OPS = (77, 142)
"""aten operations of one decoder block's forward and backward (transformers Llama)."""
REST_OPS = (34, 34)
"""Those of the embedding, final norm, head and loss, forward and backward."""
ADAMW_OPS = 12
"""Per tensor and step (torch's single-tensor AdamW)."""
ADAMW_BYTES = 48
"""Bytes streamed per element and step: parameter, gradient and two moments read, three written,
and the temporaries of the update (fp32)."""
FSDP_OPS = 6
"""Per tensor of a unit and micro-step: FSDP2's copy into the all-gather buffer, the views out of
it, the reduce-scatter's copy in (forward gather, backward gather, reduce-scatter)."""
DDP_BUCKET = 25 * 2**20
"""DDP's default bucket (bucket_cap_mb=25)."""
RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
        "send": lambda n: 1.0, "recv": lambda n: 0.0}
"""Bytes through each rank's link per byte of the buffer (a recv is its send's other end)."""
IN_ACTION = ("tp", "cp", "ep")
"""Axes whose collectives sit inside a forward or backward (the step waits for them there)."""
FP32 = 4



def axis_span(plan: Plan, axis: str) -> tuple[int, int]:
    """(group size, rank distance between a group's first and last rank) of a mesh axis, or of the
    folded groups predict_comms names ('fsdp_cp', 'dp_cp', 'ep', 'ep_replica')."""
    shape = plan.mesh_shape
    stride = {a: math.prod(shape[b] for b in MESH_ORDER[i + 1:]) for i, a in enumerate(MESH_ORDER)}
    if axis in ("fsdp_cp", "dp_cp", "ep", "ep_replica"):
        # folded data-parallel groups: cp innermost, tp below them
        size = {"fsdp_cp": plan.fsdp * plan.cp, "dp_cp": plan.dp * plan.cp, "ep": plan.ep,
                "ep_replica": plan.expert_replicas * plan.tp}[axis]
        step = 1 if axis == "ep_replica" else plan.tp
        return size, (size - 1) * step if axis != "ep_replica" else plan.data_ranks * plan.tp - 1
    a = MeshAxis(axis)
    return shape[a], (shape[a] - 1) * stride[a]


def link_of(plan: Plan, axis: str, profile: HardwareProfile) -> str:
    """'intra' when a group of `axis` fits on one host (ranks fill hosts in order), else 'inter'."""
    _, span = axis_span(plan, axis)
    return "intra" if span < profile.devices_per_host else "inter"


def comm_seconds(plan: Plan, e: CommEstimate, profile: HardwareProfile) -> float:
    """Seconds of one (op, axis) entry of predict_comms: latency per call plus ring bytes over bandwidth."""
    n, _ = axis_span(plan, e.axis)
    link = profile.link(link_of(plan, e.axis, profile), e.op, n)
    calls = e.count if e.count is not None else max(1, math.ceil(e.bytes / DDP_BUCKET))
    return calls * link.latency_s + e.bytes * RING.get(e.op, lambda _n: 1.0)(max(n, 2)) / link.bandwidth


def block_work(spec: ModelSpec, plan: Plan) -> tuple[float, float, int]:
    """(forward FLOPs per token of one decoder block on one rank, of the head, matmuls in a block's
    forward), from the parameter inventory cut by tp: a linear of E elements costs 2 E per token;
    a token meets experts_per_token of the stacked experts (its tp rank routes 1/tp of the tokens);
    causal attention costs 2 x seq x the rank's query width (half of QK^T and AV's 4 seq width)."""
    return _WORK.get_or_make((spec_key(spec), plan.tp, plan.vocab_split, plan.seq_len), lambda: _block_work(spec, plan))


_WORK = Memo(4096)


def _block_work(spec: ModelSpec, plan: Plan) -> tuple[float, float, int]:
    dense = experts = 0.0
    mm = 1  # SDPA: one fused attention kernel
    for p in param_inventory(spec):
        if p.owner != "layer" or p.layer != 0 or len(p.shape) < 2:
            continue
        n = math.prod(p.shape)
        if p.expert:
            experts += n
            continue
        dense += n / plan.tp if p.split_dim(plan) is not None else n
        mm += 1
    if experts:
        dense += experts / spec.num_experts * spec.experts_per_token / plan.tp
        mm += 3  # the routed experts' grouped matmuls
    attention = 2 * plan.seq_len * spec.num_heads * spec.head_dim / plan.tp
    head = 2 * spec.hidden_size * spec.vocab_size / (plan.tp if plan.vocab_split else 1)
    return 2 * dense + attention, head, mm


def stage_costs(spec: ModelSpec, plan: Plan, profile: HardwareProfile,
                in_action: dict[int, float] | None = None) -> list[ActionCost]:
    """One ActionCost per pipeline stage (one entry without pp): a microbatch's forward and backward
    on one rank; in_action: pipeline rank -> seconds of its tensor / context / expert collectives per
    forward, spread over its stages by their layers."""
    in_action = in_action or {}
    rate = profile.flops[plan.precision]
    oh, mm_oh = profile.op_overhead_s, profile.matmul_overhead_s
    rows = micro_rows(plan)
    tokens = rows * plan.seq_len // plan.cp
    flops, head, mm = block_work(spec, plan)
    elem = 3 * layer_parts(spec, plan, rows).total / profile.memory_bandwidth  # write once, read twice
    fwd = tokens * flops / rate + mm * mm_oh + BLOCK_OPS[0] * oh + elem
    bwd = 2 * tokens * flops / rate + 2 * mm * mm_oh + BLOCK_OPS[1] * oh + 2 * elem
    if plan.recompute == "full":
        bwd += fwd
    elif plan.recompute == "selective":
        bwd += (BLOCK_OPS[0] - mm) * oh + elem
    logits = tokens * spec.vocab_size * FP32 / (plan.tp if plan.loss_parallel else 1)
    head_f = tokens * head / rate + 2 * mm_oh + REST_OPS[0] * oh + 3 * logits / profile.memory_bandwidth
    head_b = 2 * tokens * head / rate + 4 * mm_oh + REST_OPS[1] * oh + 3 * logits / profile.memory_bandwidth
    counts = plan.layer_counts(spec.num_layers) if plan.pp > 1 else [spec.num_layers]
    out, last = [], len(counts) - 1
    held = {r: sum(counts[x] for x in plan.stage_ids(r)) for r in range(plan.pp)} if plan.pp > 1 else {0: counts[0]}
    # the schedule's own cost per action (torch's bookkeeping, posting and waiting its transfers)
    act = profile.pipeline_action_s if plan.pp > 1 else 0.0
    for s, layers in enumerate(counts):
        f, b = layers * fwd + (head_f if s == last else 0.0), layers * bwd + (head_b if s == last else 0.0)
        owner = plan.stage_owner(s) if plan.pp > 1 else 0
        share = in_action.get(owner, 0.0) * layers / max(1, held[owner])
        f, b = f + share / 2 + act, b + share / 2
        out.append(ActionCost(f, b / 2 + act, b / 2 + act) if plan.zero_bubble else ActionCost(f, b + act))
    return out


def _comm_by_axis(spec: ModelSpec, plan: Plan, profile: HardwareProfile, rank: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in predict_comms(spec, plan, rank):
        if plan.pp > 1 and e.axis == "pp":
            continue  # inside the schedule's replay, as transfers between stages
        out[e.axis] = out.get(e.axis, 0.0) + comm_seconds(plan, e, profile)
    return out


def _data_parallel_overhead(spec: ModelSpec, plan: Plan, profile: HardwareProfile, rank: int) -> float:
    """Seconds FSDP2's copies in and out of its buffers, DDP's bucket copies and AdamW take on `rank`."""
    tensors = local_tensors(spec, plan, rank)
    bw, oh = profile.memory_bandwidth, profile.op_overhead_s
    held = sum(h for _, h, _ in tensors)
    seconds = len(tensors) * ADAMW_OPS * oh + held * ADAMW_BYTES / bw
    if plan.fsdp > 1:
        full = sum(s for _, _, s in tensors) * plan.fsdp * plan.cp * FP32
        seconds += plan.grad_accum * (len(tensors) * FSDP_OPS * oh + 6 * full / bw)
    elif plan.uses_ddp:
        seconds += 2 * held * FP32 / bw
    return seconds


def representative_ranks(plan: Plan) -> list[int]:
    """One rank per pipeline coordinate, the others at 0: the ranks holding the largest shards
    (torch.chunk puts the remainder first), whose step is the slowest of its stage."""
    shape = plan.mesh_shape
    return [mesh_rank({MeshAxis.PP: p}, shape) for p in range(plan.pp)]


def plan_seconds(spec: ModelSpec, plan: Plan, profile: HardwareProfile) -> dict[int, dict[str, float]]:
    """Per representative rank: compute / comm / bubble seconds of one optimizer step and its
    communication per axis ('axis:tp', ...). The pipeline is replayed once for all of them."""
    ranks = representative_ranks(plan)
    # pipeline ranks whose stages hold as many layers (and the same ends) communicate alike
    counts, alike, by_axis = plan.layer_counts(spec.num_layers), {}, {}
    for p, r in enumerate(ranks):
        stages = plan.stage_ids(p) if plan.pp > 1 else [0]
        sig = (tuple(counts[s] for s in stages), 0 in stages, len(counts) - 1 in stages)
        if sig not in alike:
            alike[sig] = _comm_by_axis(spec, plan, profile, r)
        by_axis[r] = alike[sig]
    inside = {r: sum(v for a, v in by_axis[r].items() if a in IN_ACTION) for r in ranks}
    forwards = plan.grad_accum * (plan.n_microbatches if plan.pp > 1 else 1)
    if plan.pp > 1:
        # a stage's collectives are its owner's: each pp rank's own share, per forward
        per_stage = stage_costs(spec, plan, profile, {p: inside[r] / forwards for p, r in enumerate(ranks)})
        act = spec.hidden_size * micro_rows(plan) * plan.seq_len // plan.cp * stream_bytes(plan)
        # a receiver already waiting's figure: the replay holds the wait for the sender's compute
        link = profile.link(link_of(plan, "pp", profile), "recv", 2)
        span, busy = simulate(plan, per_stage, link.latency_s + act / link.bandwidth, core_speed(plan, profile),
                              profile.core_handoff_s)
    out = {}
    for r in ranks:
        pp_rank = mesh_coords(r, plan.mesh_shape)[MeshAxis.PP]
        sped = 1.0  # the replayed share of the actions' costs (ranks sharing cores speed both halves)
        if plan.pp > 1:
            work, bubble = plan.grad_accum * busy[pp_rank], plan.grad_accum * (span - busy[pp_rank])
            cost = plan.n_microbatches * sum(per_stage[x].f + per_stage[x].b + per_stage[x].w
                                             for x in plan.stage_ids(pp_rank))
            sped = busy[pp_rank] / cost if cost > 0 else 1.0
        else:
            c = stage_costs(spec, plan, profile, {0: inside[r] / forwards})[0]
            work, bubble = plan.grad_accum * (c.f + c.b + c.w), 0.0
        waited = inside[r] * sped
        compute = work - waited + _data_parallel_overhead(spec, plan, profile, r) + profile.step_overhead_s
        if plan.replicates_gradients:
            compute += profile.replica_overhead_s
        outside = sum(v for a, v in by_axis[r].items() if a not in IN_ACTION)
        # Overlappable: every bucket or unit but the last, behind the backward (DDP) or the other
        # units' compute (FSDP's prefetch, replicate's per-unit reduction); not pp's end-of-step ones.
        units = max(1, spec.num_layers // plan.pp)
        hidden = 0.0 if plan.pp > 1 else profile.overlap * min(outside * (1 - 1 / (units + 1)), compute)
        out[r] = {"compute": compute, "comm": waited + outside - hidden, "bubble": bubble,
                  **{f"axis:{a}": v for a, v in by_axis[r].items()}}
    return out


def model_flops(spec: ModelSpec, plan: Plan) -> float:
    """FLOPs of one step as MFU counts them: 3 x the forward's matmuls (no recomputation, no tp cut)."""
    whole = plan.replace(tp=1, loss_parallel=False)
    block, head, _ = block_work(spec, whole)
    return 3 * plan.batch_size * plan.seq_len * (spec.num_layers * block + head)


def predict_step(model: ModelSpec, plan: Plan, profile: HardwareProfile | str, *,
                 memory_per_rank: int | None = None, memory: bool = True) -> StepPrediction:
    """One plan's predicted optimizer step on `profile`: seconds of the slowest rank, split into
    compute, exposed communication and pipeline bubble; global tokens/s; MFU; and (memory) the
    fullest rank's predicted peak bytes against memory_per_rank (default: the profile's)."""
    from .hardware import get_profile

    profile = get_profile(profile)
    per_rank = plan_seconds(model, plan, profile)
    slow = max(per_rank, key=lambda r: per_rank[r]["compute"] + per_rank[r]["comm"] + per_rank[r]["bubble"])
    t = per_rank[slow]
    seconds = t["compute"] + t["comm"] + t["bubble"]
    peak = 0
    if memory:
        peak = max(rank_peak(model, plan, m) for m in predict_memory(model, plan, ranks=representative_ranks(plan)))
    budget = memory_per_rank or profile.memory_bytes
    tokens = plan.batch_size * plan.seq_len
    return StepPrediction(
        plan=plan.describe(), profile=profile.name, seconds=seconds, compute_s=t["compute"], comm_s=t["comm"],
        bubble_s=t["bubble"], tokens_per_s=tokens / seconds,
        mfu=model_flops(model, plan) / seconds / (plan.world_size * profile.peak_flops[plan.precision]),
        memory_bytes=peak, fits=peak <= budget, rank=slow,
        plan_fields={k: list(v) if isinstance(v, tuple) else v for k, v in plan.to_dict().items()},  # as JSON holds it
        comm_by_axis={k[5:]: v for k, v in t.items() if k.startswith("axis:")})
