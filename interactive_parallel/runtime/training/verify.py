"""Check the applied plan against a single-process reference on the same weights and batch.

Owns the tolerances, the loss seen by the whole group (ranks that do not see it, like
early pipeline stages, are left out of the mean), one forward/backward without an
optimizer step, and the comparison. The reference is built on rank 0 only: every rank
sends rank 0 its pieces of each weight and gradient (runtime.layout.pieces: logical ranges, so
any layout, TP permutation and pipeline split included), one tensor at a time, so no
other rank ever holds a whole tensor of it and rank 0 holds the whole model once (the
reference) plus the gathered gradients. Before anything moves, rank 0 compares what that
needs with what its machine has; when it would not fit, every rank returns a report that
says so with the numbers instead of trying. Rank 0 broadcasts the report: the same on
every rank. Knows nothing of how the plan is laid out beyond what runtime.layout.pieces gives.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...plan import Plan
from ...records import ParamDiff, VerifyReport
from ..layout.parallelized import Parallelized
from .train import forward_backward, local_batch

# Absolute differences allowed against the single-process reference. fp32: the sums run
# in another order across ranks, which moves the last bits only, an order of magnitude or
# more below these; bf16 rounds activations to 8 mantissa bits, hence the wider tolerance (fp16
# shares it). A plan whose FSDP gathers bf16 parameters is compared with a reference that computes
# on bf16 copies of its parameters too (computes_like): what is left is the order of the sums and
# where bf16 gradients are summed (per rank, then in fp32 across ranks), within the same bound.
TOLERANCE: dict[str, dict[str, float]] = {
    "fp32": {"loss": 1e-5, "grad": 1e-5},
    "bf16": {"loss": 1e-2, "grad": 1e-2},
    "fp16": {"loss": 1e-2, "grad": 1e-2},
}


def global_loss(par: Parallelized, value: float) -> float:
    """Mean over the ranks that see a loss of `value` (a collective over the world)."""
    if not dist.is_initialized():
        return value
    seen = par.sees_loss and not math.isnan(value)
    # On the group's device: an NCCL group takes no CPU tensor.
    t = torch.tensor([value if seen else 0.0, 1.0 if seen else 0.0], dtype=torch.float64, device=par.device)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def zero_grads(par: Parallelized) -> None:
    for p in par.parameters():
        p.grad = None


def loss_and_grads(par: Parallelized, step: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss of the batch of `step` and full gradients on every rank, no optimizer step (a
    collective). For tests of small models: verify() gathers on rank 0 only."""
    zero_grads(par)
    loss = global_loss(par, forward_backward(par, local_batch(par, step)))
    grads = par.full_grads()
    zero_grads(par)
    return loss, grads


def reference_plan(plan: Plan) -> Plan:
    return Plan(device=plan.device, batch_size=plan.batch_size, seq_len=plan.seq_len, grad_accum=plan.grad_accum,
                precision=plan.precision, lr=plan.lr, max_grad_norm=plan.max_grad_norm, seed=plan.seed)


def computes_like(plan: Plan) -> Plan | None:
    """What the one-process reference of `plan` casts as `plan` does beyond its precision: the
    plan itself where FSDP gathers bf16 parameters (Plan.gathers_bf16), so the reference computes
    on bf16 copies of its fp32 parameters too; else None (autocast alone)."""
    return plan if plan.gathers_bf16 else None


def reference_bytes(par: Parallelized) -> int:
    """What the reference needs on rank 0: its weights and gradients, the gathered gradients of
    the plan and one gathered weight in flight (fp32), and its activations (plan/estimate)."""
    from ...plan.estimate import predict_activations

    n = sum(math.prod(t.shape) for t in par.raw.state_dict().values())
    return int(4 * n * 3 + predict_activations(par.spec, reference_plan(par.plan), 0))


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def gather_to_first(par: Parallelized, tensors: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Full logical CPU tensors on rank 0 ({} elsewhere), one name at a time (a collective).

    `tensors`: canonical name -> this rank's tensor (DTensor or plain); absent where the rank
    holds none. Every rank passes the same `names`, in the same order.
    """
    from ..layout.pieces import pieces

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    out: dict[str, torch.Tensor] = {}
    for name in names:
        t = tensors.get(name)
        mine = [] if t is None else [(p.offsets, p.view.detach().to("cpu", copy=True))
                                     for p in pieces(t, par.perms.get(name))]
        shape = None if t is None else tuple(t.shape)
        parts: list = [None] * world if rank == 0 else None
        if world > 1:
            dist.gather_object((shape, mine), parts, dst=0)
        else:
            parts = [(shape, mine)]
        if rank != 0:
            continue
        full_shape = next((s for s, _ in parts if s is not None), None)
        if full_shape is None:
            continue
        full = torch.empty(full_shape, device="cpu")
        for _, held in parts:
            for offsets, data in held:
                full[tuple(slice(o, o + n) for o, n in zip(offsets, data.shape))] = data
        out[name] = full
    return out


def _names(par: Parallelized) -> list[str]:
    """Every parameter's canonical name, the same list on every rank (meta ones included)."""
    return list(dict.fromkeys(par.canonical(n) for n, _ in par.raw.named_parameters(remove_duplicate=False)))


def _held(par: Parallelized, grads: bool) -> dict[str, torch.Tensor]:
    from ..layout.initialize import owned_parameters

    out = {}
    for name, p in owned_parameters(par).items():
        t = p.grad if grads else p
        if t is not None and any(pl.is_partial() for pl in getattr(t, "placements", ())):
            # A replicated weight used on sharded activations (sequence-parallel norms, Qwen3's
            # per-head norms) has each rank's share of its gradient, not the sum, until redistributed
            t = t.redistribute(placements=p.placements)
        if t is not None:
            out[name] = t
    return out


def reference_loss_and_grads(par: Parallelized, weights: dict, step: int) -> tuple[float, dict]:
    """The same computation in this process alone, on a plain copy of the model."""
    from ..layout.initialize import owned_parameters
    from ..layout.parallelize import parallelize

    ref = parallelize(par.spec, reference_plan(par.plan), device=par.device, fill="none")
    ref.computes_like = computes_like(par.plan)
    with torch.no_grad():
        for name, p in owned_parameters(ref).items():
            p.copy_(weights.pop(name))
    loss = forward_backward(ref, local_batch(ref, step))
    grads = {n: p.grad.detach().to("cpu") for n, p in owned_parameters(ref).items() if p.grad is not None}
    return loss, grads


def compare(loss_ref: float, loss_par: float, grads_ref: dict, grads_par: dict, precision: str) -> VerifyReport:
    tol = TOLERANCE.get(precision, TOLERANCE["fp32"])
    params = []
    worst = 0.0
    for name, g in grads_ref.items():
        other = grads_par.get(name)
        if other is None:
            diff = math.inf
        else:
            diff = float((other.float() - g.float()).abs().max())
        worst = max(worst, diff)
        params.append(ParamDiff(name=name, shape=list(g.shape), max_abs_diff=diff))
    dloss = abs(loss_par - loss_ref)
    ok = dloss <= tol["loss"] and worst <= tol["grad"]
    return VerifyReport(ok=bool(ok), tolerance=dict(tol), loss_ref=loss_ref, loss_par=loss_par, dloss=dloss,
                        max_grad_diff=worst, params=params)


def _broadcast(report: VerifyReport | None) -> VerifyReport:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return report
    box = [report]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fits(par: Parallelized, limit_bytes: int | None) -> str:
    """'' when rank 0 can build the reference, else why not with the numbers (the same on every rank)."""
    note = ""
    if not dist.is_initialized() or dist.get_rank() == 0:
        need, have = reference_bytes(par), available_bytes(par.device)
        if limit_bytes is not None:
            have = min(have, int(limit_bytes))
        if need > have:
            note = (f"the one-process reference needs ~{need / 2**20:,.0f} MiB on rank 0 (weights, gradients, "
                    f"gathered gradients, activations) and rank 0 has {have / 2**20:,.0f} MiB available")
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [note]
        dist.broadcast_object_list(box, src=0)
        note = box[0]
    return note


def verify(par: Parallelized, step: int = 0, *, limit_bytes: int | None = None) -> VerifyReport:
    """Loss and every gradient of the plan vs one process, on the batch of `step` (a collective)."""
    tol = TOLERANCE.get(par.plan.precision, TOLERANCE["fp32"])
    note = _fits(par, limit_bytes)
    if note:
        return VerifyReport(ok=False, tolerance=dict(tol), loss_ref=math.nan, loss_par=math.nan, dloss=math.nan,
                            max_grad_diff=math.nan, plan=par.plan.describe(), note=note)
    names = _names(par)
    zero_grads(par)
    loss_par = global_loss(par, forward_backward(par, local_batch(par, step)))
    grads_par = gather_to_first(par, _held(par, grads=True), names)
    zero_grads(par)
    weights = gather_to_first(par, _held(par, grads=False), names)
    report = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        loss_ref, grads_ref = reference_loss_and_grads(par, weights, step)
        report = compare(loss_ref, loss_par, grads_ref, grads_par, par.plan.precision)
        report.plan = par.plan.describe()
    return _broadcast(report)
