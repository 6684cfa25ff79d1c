"""Data parallel with replicated parameters: DDP for pure dp, FSDP2-style `replicate` in combinations.

Owns wrapping a model so gradients are averaged over the mesh's data-parallel group.
Knows nothing of how the batch is split (runtime.training.data does that) or of other axes.
"""
from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..rank.channel import ddp_vote_hook


def apply_dp(model: nn.Module, mesh, axis: str = "dp", device=None, comm_hook=None) -> nn.Module:
    """DDP over `mesh[axis]`. Gradients are all-reduced in buckets during backward, through
    runtime.rank.channel.ddp_vote_hook unless `comm_hook` replaces it (the dry run's, on a fake group).

    DDP over DataParallel: one process per replica (no GIL, no scatter of inputs and
    gather of outputs through one device each step), and the gradient all-reduce
    overlaps the backward pass bucket by bucket.
    """
    group = mesh[axis].get_group()
    device_ids = [device] if device is not None and getattr(device, "type", "cpu") == "cuda" else None
    # No per-forward buffer sync: the models here have no buffers that change in training
    # (rotary tables are constant). forward_sync_buffers replaces the deprecated
    # broadcast_buffers on this torch; it still syncs once at init, which is harmless here.
    ddp = DistributedDataParallel(model, process_group=group, device_ids=device_ids, forward_sync_buffers=False)
    # DDP's averaging, with the stop vote aboard (`comm_hook(group, bucket)`: another, once only)
    ddp.register_comm_hook(group, comm_hook or ddp_vote_hook(group))
    return ddp


def apply_replicate(model: nn.Module, mesh, layers: list[nn.Module], ignored: set | None = None) -> nn.Module:
    """DDP semantics for models whose parameters are already DTensors (TP) or pipeline stages.

    DDP refuses DTensor parameters, and wrapping a pipeline stage in DDP fights the
    schedule's own backward; torch's FSDP2-based `replicate` composes with both (the
    pipeline stage toggles its gradient sync per microbatch). Gradients are averaged over
    the group during backward (checked against one process in the parity tests: a missing
    sync would show as replicas drifting apart, not as an error).
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for layer in layers:
        replicate(layer, mesh=mesh, ignored_params=ignored)
    replicate(model, mesh=mesh, ignored_params=ignored)
    return model
