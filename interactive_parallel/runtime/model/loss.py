"""The training loss: mean token cross-entropy over (batch, seq) logits and their targets.

Owns only that, so both the training step (runtime.training.train) and the pipeline schedule's
last stage (runtime.parallel.pp) compute one loss without importing each other; and the
context it runs in under Plan.loss_parallel: logits split on the vocabulary (a DTensor,
runtime.parallel.tp) go to torch's `loss_parallel()`, which takes the cross-entropy with a
max and a sum all-reduced over the shards and never gathers the logits; its backward must
run inside the same context. Knows nothing of layouts, accumulation or precision.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ...plan import Plan


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of [b, s, vocab] logits (computed in fp32) against [b, s] token ids.

    Logits split on the vocabulary (a DTensor) must come inside `loss_context`, and so must the
    backward. The loss is a plain tensor either way: the replicated scalar's local copy, through
    `to_local`'s backward (the gradient goes back in as the same replicated DTensor), so adding
    a router loss, scaling, reading and all-reducing it need not know of DTensors."""
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))  # [b*s, vocab]
    return loss.to_local() if hasattr(loss, "to_local") else loss


def loss_context(plan: Plan):
    """Where the loss and its backward run: torch's loss_parallel under Plan.loss_parallel."""
    if plan.tp > 1 and plan.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()
