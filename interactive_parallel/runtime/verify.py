"""Check the applied plan against a single-process reference on the same weights and batch.

Owns the tolerances, the loss seen by the whole group (ranks that do not see it, like
early pipeline stages, are left out of the mean), one forward/backward without an
optimizer step on full gradients, and the comparison. The reference runs on every rank
(same inputs, same deterministic CPU kernels, so every rank returns the same report);
it is a full copy of the model, so this is for models that fit one rank. Knows nothing
of how the plan is laid out: Parallelized gathers full weights and gradients.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..plan import Plan
from ..records import ParamDiff, VerifyReport
from .parallelize import parallelize
from .parallelized import Parallelized
from .train import forward_backward, local_batch

# Absolute differences allowed against the single-process reference. fp32: the sums run
# in another order across ranks (measured ~1e-6 on loss, ~1e-8 on gradients); bf16 autocast
# rounds activations to 8 mantissa bits (measured: loss ~5e-5, gradients ~1e-3).
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
    """Loss of the batch of `step` and full gradients, no optimizer step (a collective)."""
    zero_grads(par)
    loss = global_loss(par, forward_backward(par, local_batch(par, step)))
    grads = par.full_grads()
    zero_grads(par)
    return loss, grads


def reference_plan(plan: Plan) -> Plan:
    return Plan(device=plan.device, batch_size=plan.batch_size, seq_len=plan.seq_len, grad_accum=plan.grad_accum,
                precision=plan.precision, lr=plan.lr, seed=plan.seed)


def reference_loss_and_grads(par: Parallelized, weights: dict, step: int) -> tuple[float, dict]:
    """Same computation in this process alone, on a plain copy of the model."""
    ref = parallelize(par.spec, reference_plan(par.plan), state_dict=weights, device=par.device)
    loss = forward_backward(ref, local_batch(ref, step))
    grads = {n: p.grad.detach().to("cpu") for n, p in ref.raw.named_parameters() if p.grad is not None}
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


def verify(par: Parallelized, step: int = 0) -> VerifyReport:
    """Loss and every gradient of the plan vs one process, on the batch of `step` (a collective)."""
    weights = par.full_state_dict()
    loss_par, grads_par = loss_and_grads(par, step)
    loss_ref, grads_ref = reference_loss_and_grads(par, weights, step)
    report = compare(loss_ref, loss_par, grads_ref, grads_par, par.plan.precision)
    report.plan = par.plan.describe()
    return report
