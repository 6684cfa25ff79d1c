"""The training loss: mean token cross-entropy over (batch, seq) logits and their targets.

Owns only that, so both the training step (runtime.train) and the pipeline schedule's
last stage (runtime.parallel.pp) compute one loss without importing each other. Knows
nothing of layouts, accumulation or precision.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of [b, s, vocab] logits (computed in fp32) against [b, s] token ids."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))  # [b*s, vocab]
