"""Activation recomputation (activation checkpointing) of the decoder layers: none, selective, full.

Owns the Plan's `recompute` knob, applied per decoder layer with torch's composable
`checkpoint` (torch.distributed._composable: forward hooks, so parameter names stay the
model's, unlike a wrapper module). 'full' keeps only each layer's input and recomputes
the whole layer in backward. 'selective' recomputes only the cheap ops: the outputs of
matmuls, attention and collectives are saved (torch.utils.checkpoint's selective
checkpoint policy), norms, activations and other pointwise ops are recomputed, as in
Korthikanti et al. and torchtitan's op-level policy. Applied after TP and CP and before
FSDP/replicate, so FSDP's hooks wrap the recomputed region (as torchtitan orders them).
Knows nothing of the mesh or of the other axes.
"""
from __future__ import annotations

from torch import nn

from ...plan.plan import RECOMPUTES


def _save_list() -> set:
    import torch

    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None:
        # Recomputing a collective would issue it again in backward: keep its output.
        for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor"):
            if hasattr(functional, name):
                ops.add(getattr(functional, name).default)
    return ops


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _save_list()

    def policy(_ctx, op, *_args, **_kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(layers: list[nn.Module], mode: str) -> None:
    """Recompute the activations of each of `layers` in backward, as `mode` says."""
    if mode == "none":
        return
    if mode not in RECOMPUTES:
        raise ValueError(f"recompute {mode!r} is not one of {', '.join(RECOMPUTES)}")
    from torch.distributed._composable import checkpoint

    kwargs = {"context_fn": _selective_context} if mode == "selective" else {}
    for layer in layers:
        checkpoint(layer, **kwargs)
