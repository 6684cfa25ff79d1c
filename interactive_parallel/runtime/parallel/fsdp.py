"""Sharded data parallel (FSDP2 `fully_shard`): parameters, gradients and optimizer state split.

Owns wrapping the decoder layers (one all-gather / reduce-scatter unit each) and then the
root module that holds the embeddings and head. With a 2-D (dp, fsdp) mesh this is HSDP:
shard inside fsdp, replicate across dp. Parameters that tensor parallel already made
DTensors on a sibling tp axis become 2-D (FSDP x TP) by themselves. Knows nothing of how
the batch is split or of the pipeline.
"""
from __future__ import annotations

from torch import nn


def mixed_precision(precision: str):
    """fp32 parameters and fp32 gradient reduction under every precision.

    bf16 runs under autocast (train.autocast), as it does without FSDP, so FSDP plans run
    the same numerics as every other plan and verify() compares like with like.
    `precision` is taken so a future param_dtype choice has one place to go.
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)


def apply_fsdp(model: nn.Module, mesh, layers: list[nn.Module], *, precision: str = "fp32",
               reshard_after_forward: bool = True, ignored: set | None = None) -> nn.Module:
    """fully_shard each of `layers`, then `model` as the root unit, over `mesh`.

    FSDP2 averages gradients over the shard (and, under HSDP, replicate) ranks itself;
    on gloo its reduce-scatter runs (reduce_scatter_tensor and ReduceOp.AVG both work on
    this torch, measured) and gradients equal the single-process mean (parity tests).
    """
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision(precision)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    return model
