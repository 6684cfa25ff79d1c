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
    """What FSDP gathers and what it reduces in, as torchtitan runs it: under bf16 the units
    gather bf16 parameters (half the all-gather bytes) and compute in bf16, and reduce-scatter
    fp32 gradients onto the fp32 shards the optimizer steps (Plan.gathers_bf16). fp32 and fp16
    gather fp32: fp16 stays autocast over fp32 parameters, as every other fp16 plan, since its
    loss scaling is written for that.
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = torch.bfloat16 if precision == "bf16" else None
    # cast_forward_inputs=False: what reaches a unit is already bf16 (the embedding's and every
    # layer's output, the pipeline's receive buffers, ids are integers), and the cast's profiler
    # range inside a layer that 'selective' recomputation checkpoints (runtime.parallel.ac: hooks,
    # FSDP's run inside the recomputed region, where torchtitan's wrapper puts them outside)
    # fails its backward with "encountered during backward but not found in storage" (measured).
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def cast_parameters(model: nn.Module, dtype, skip=()) -> dict:
    """{name: parameter cast to `dtype`} for torch.func.functional_call: one process computing as
    FSDP's units do under `mixed_precision` (the cast is differentiable, so gradients arrive on
    the fp32 parameters in fp32, as FSDP's reduce gives them). `skip`: parameters FSDP leaves
    out (the experts under ep), kept as they are."""
    skipped = {id(p) for p in skip}
    return {n: p if id(p) in skipped else p.to(dtype) for n, p in model.named_parameters()}


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
