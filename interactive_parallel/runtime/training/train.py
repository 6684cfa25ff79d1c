"""One optimizer step on this rank: its slice of the global batch, accumulation, precision, AdamW.

Owns gradient accumulation, autocast/scaler, the optimizer and the StepRecord, and the
three ways a micro-batch runs: a plain forward/backward, a pipeline schedule step (PP:
the last stage computes the loss, runtime.parallel.pp.pipeline_loss) and a
context-parallel forward on this rank's share of the sequence (CP). The loss itself is
runtime.model.loss.token_loss, taken with its backward inside runtime.model.loss.loss_context (torch's
loss_parallel on vocabulary-split logits under Plan.loss_parallel). Knows nothing of how the
parallelisms are laid out: Parallelized says which rows are ours and which module or schedule
to call.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from ...plan import MeshAxis, Plan
from ...records import StepRecord
from ..layout.parallelized import Parallelized
from ..model.loss import loss_context, token_loss
from .data import local_batch as make_local_batch


def scalar(t: torch.Tensor) -> float:
    """`t.item()`, or NaN for a tensor without data: a dry run (runtime.client.dryrun) trains on
    torch's fake tensors, whose values do not exist."""
    return math.nan if is_fake(t) else t.item()


def make_optimizer(par: Parallelized, foreach: bool | None = None) -> torch.optim.Optimizer:
    """AdamW over this rank's parameters (shards under FSDP, so the moments are sharded too).

    foreach (default: on for CUDA, off for CPU): the multi-tensor kernels save a launch per
    tensor on a GPU; the per-tensor loop is the CPU choice. One foreach call cannot mix plain
    tensors and DTensors (pp2 x tp2 raises "got mixed torch.Tensor and DTensor"),
    so the parameters go into one group per kind (plain, or DTensor per mesh).
    """
    if foreach is None:
        foreach = par.device.type == "cuda"
    params = par.parameters()
    if not foreach:
        return torch.optim.AdamW(params, lr=par.plan.lr, foreach=False)
    groups: dict = {}
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        groups.setdefault(None if mesh is None else id(mesh), []).append(p)
    return torch.optim.AdamW([{"params": g} for g in groups.values()], lr=par.plan.lr, foreach=True)


def make_scaler(plan: Plan):
    """A gradient scaler for fp16 on the plan's device (None otherwise).

    With peers it is runtime.training.scaler.DTensorGradScaler, torch's ShardedGradScaler made to take
    DTensor gradients (tp, fsdp x tp, pp x tp mix them with plain ones, which torch's own
    refuses): each rank sees only its own shards or stages, so an inf found on one must skip
    the step (and shrink the scale) on all, or the replicas drift apart; it all-reduces the
    found-inf flags over the world group.
    """
    if plan.precision != "fp16":
        return None
    if dist.is_initialized() and dist.get_world_size() > 1:
        from .scaler import DTensorGradScaler

        return DTensorGradScaler(plan.device, process_group=dist.group.WORLD)
    return torch.amp.GradScaler(plan.device)


def autocast(plan: Plan, device: torch.device):
    if plan.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if plan.precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def no_sync(par: Parallelized, last: bool):
    """Skip DDP's gradient all-reduce on all but the last accumulation micro-step."""
    if not last and hasattr(par.model, "no_sync"):
        return par.model.no_sync()
    return contextlib.nullcontext()


def _pipeline_micro(par: Parallelized, mb: torch.Tensor, scaler) -> float:
    from ..parallel.pp import scaled_loss

    losses: list[torch.Tensor] = []
    args = (mb[:, :-1],) if par.has_first else ()
    kwargs = dict(target=mb[:, 1:], losses=losses) if par.sees_loss else {}
    # The schedule runs the backward itself, from the loss its loss_fn returns: the scale
    # goes in there, or the scaler would unscale gradients that were never scaled.
    if scaler is not None:
        # Ranks without the last stage never scale a loss (their gradients arrive scaled
        # from the next stage), but unscale_ needs the scale: this starts it on every rank.
        scaler.scale(torch.ones((), device=par.device))
    with autocast(par.plan, par.device), scaled_loss(scaler), loss_context(par.plan):
        par.schedule.step(*args, **kwargs)
    if not losses:
        return math.nan
    return float(sum(scalar(x) for x in losses)) / (scaler.get_scale() if scaler else 1.0)


def _cp_micro(par: Parallelized, mb: torch.Tensor, scaler) -> float:
    from ..parallel.cp import local_positions, shard_sequence

    cp, r = par.plan.cp, par.coords[MeshAxis.CP]
    ids, targets = shard_sequence(mb[:, :-1], cp, r), shard_sequence(mb[:, 1:], cp, r)
    pos = local_positions(ids.shape[1], cp, r, ids.device).unsqueeze(0)
    with autocast(par.plan, par.device):
        logits = par.model(ids, position_ids=pos)
    # Each cp rank's mean is over its own tokens; the replicate/FSDP wrapper averages the
    # gradients over cp ranks, which makes them those of the whole sequence's mean.
    with loss_context(par.plan):
        loss = par.with_router_loss(token_loss(logits, targets) / par.plan.grad_accum)
        (scaler.scale(loss) if scaler else loss).backward()
    value = loss.detach().clone()
    dist.all_reduce(value, group=par.group(MeshAxis.CP))
    return scalar(value) / cp


def forward_backward(par: Parallelized, batch: torch.Tensor, scaler=None) -> float:
    """Gradients of this rank's rows of the batch (accumulated over micro-steps); the loss it sees."""
    plan = par.plan
    par.refresh_schedule()
    micro = batch.chunk(plan.grad_accum)
    total = 0.0
    for i, mb in enumerate(micro):
        if par.schedule is not None:
            total += _pipeline_micro(par, mb, scaler)
            continue
        if par.cp_model is not None:
            total += _cp_micro(par, mb, scaler)
            continue
        with no_sync(par, last=i == len(micro) - 1):
            with autocast(plan, par.device):
                logits = par.forward_logits(mb[:, :-1], sharded=True)  # [b, s, vocab/tp] under loss parallel
            with loss_context(plan):
                loss = par.with_router_loss(token_loss(logits, mb[:, 1:]) / plan.grad_accum)
                (scaler.scale(loss) if scaler else loss).backward()
        total += scalar(loss)
    from ..probes.causes import phase

    with phase("backward"):  # the gradient sync that completes backward
        par.finish_grads()
    return total


def local_batch(par: Parallelized, step: int) -> torch.Tensor:
    """This rank's rows of the batch of `step`, in the model's tokenizer's ids, from the text the
    running call reads (runtime.training.data.reading; none: the synthetic task)."""
    from ..model.tokenizer import tokenizer_for
    from .data import current_source

    plan = par.plan
    return make_local_batch(plan.seed, step, plan.batch_size, plan.seq_len, par.data_index, par.data_count,
                            tok=tokenizer_for(par.spec), source=current_source()).to(par.device)


def train_step(par: Parallelized, optimizer, step: int, *, scaler=None, rank: int = 0,
               after_backward: Callable[[], None] | None = None) -> StepRecord:
    """One optimizer step on this rank's share of the global batch. `after_backward` runs once
    the gradients are ready, before the update (a driver casts its stop vote there)."""
    from .. import probes

    plan = par.plan
    t0 = time.perf_counter()
    par.refresh_schedule()  # before the probes instrument it
    if par.routing is not None:
        par.routing.take(step, rank)  # what generation routed since the last step is not this step's
    with probes.step(par, optimizer, step, rank) as probe:
        batch = local_batch(par, step)
        total = forward_backward(par, batch, scaler)
        if after_backward is not None:
            after_backward()
        norm = _clip(par, optimizer, scaler) if plan.max_grad_norm > 0 else None
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    memory, comms, events = probe.records()
    return StepRecord(rank=rank, step=step, loss=total if par.sees_loss else math.nan,
                      tokens=int(batch[:, :-1].numel()), time_s=time.perf_counter() - t0,
                      plan=plan.describe(), grad_norm=norm, lr=plan.lr, memory=memory, comms=comms, events=events,
                      experts=par.routing.take(step, rank) if par.routing is not None else [])


def _clip(par: Parallelized, optimizer, scaler) -> float:
    """The gradients clipped to plan.max_grad_norm (unscaled first under fp16: the scaler then
    knows not to unscale them again); the norm before clipping."""
    from .clip import clip_grad_norm

    if scaler:
        scaler.unscale_(optimizer)
    params = list({id(p): p for g in optimizer.param_groups for p in g["params"]}.values())
    return clip_grad_norm(par, params, par.plan.max_grad_norm)
