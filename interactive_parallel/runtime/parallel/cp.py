"""Context parallel: the sequence split across the cp mesh axis, attention over the whole of it.

Owns an attention function registered with transformers (the model code is not edited: the
config's attention implementation is switched to it), which runs the plan's cp_method (the
all-gather here, the ring in runtime.parallel.ring) over the load-balanced split. Knows nothing of the other axes; gradient averaging over
cp ranks is the data-parallel wrapper's job (cp ranks act as data-parallel ranks for parameters).

Why not torch's `context_parallel`: on this torch it has no sharding strategy for the
CPU SDPA kernel, so causal attention does not run on CPU (measured). With 'allgather' each rank
all-gathers K and V of the whole sequence (O(seq) memory per rank, unlike a ring, but
one collective per layer and exact) and attends with its own queries under a causal
mask written in global positions.

Load balance (runtime.parallel.cp_split): the sequence is cut into 2*cp chunks and rank r
keeps chunks r and 2*cp-1-r, so under a causal mask every rank does the same attention work.

Generation: the prompt's forward (prefill) runs split like a training step, inside
`prefill(cache, key_mask)`: the keys and values each rank gathers anyway are what the
transformers cache keeps for its layer (the whole sequence, so later tokens can attend to
all of it), and padding keys are hidden. The decoding steps after it run the whole (short)
sequence on every cp rank (`whole_sequence()`), against that cache, under the caller's mask.

Ring (`Plan(cp_method="ring")`, runtime.parallel.ring): training forwards and backwards pass
K/V blocks rank to rank instead of gathering them. A prefill under ring fills the cache
through the all-gather above (one all-gather of K/V per layer: the cache keeps the whole
prompt on every rank anyway); decoding is as today.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .cp_split import local_positions, shard_sequence
from .ring import ring_attention

__all__ = ["apply_cp", "cp_attention", "local_positions", "prefill", "shard_sequence", "whole_sequence"]

IMPL = "ip_context_parallel"
_ENABLED = [True]
_PREFILL: list = [None]
"""(cache, key mask [b, s] in global order) while a cached prefill runs split, else None."""


class _GatherSeq(torch.autograd.Function):
    """all_gather along the sequence; backward sums every rank's gradient and keeps ours.

    Own Function instead of torch.distributed.nn.functional.all_gather: on gloo that one
    runs its backward as an all_to_all of (possibly non-contiguous) gradients, which gave
    wrong dK/dV (see notes). An all_reduce of one contiguous tensor is plainly right.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(n)]  # cp x [b, heads, s/cp, d]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)  # [cp, b, heads, s/cp, d]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # [cp, b, heads, s/cp, d], summed over ranks
        return grad[dist.get_rank(ctx.group)], None  # [b, heads, s/cp, d]


def _whole_sequence(t: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(B, H, S_local, D) per rank -> (B, H, S, D) in global order."""
    parts = _GatherSeq.apply(t, group)  # [cp, b, heads, s/cp, d]
    halves = parts.chunk(2, dim=3)  # 2 x [cp, b, heads, s/2cp, d]: each rank's two chunks
    order = [halves[0][r] for r in range(cp)] + [halves[1][r] for r in reversed(range(cp))]
    return torch.cat(order, dim=2)  # [b, heads, s, d], global order


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, 1) if groups > 1 else t  # [b, kv_heads, s, d] -> [b, heads, s, d]


def cp_attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                 scaling: float | None = None, **kwargs):
    """transformers attention interface: (B, H, S_local, D) q/k/v -> ((B, S_local, H, D), None)."""
    group = getattr(module, "_ip_cp_group", None)
    groups = getattr(module, "num_key_value_groups", 1)
    if group is None or not _ENABLED[0]:
        # Decoding runs the whole sequence on every cp rank; with a cache the caller gives the mask.
        key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
        causal = attention_mask is None and query.shape[2] > 1
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, is_causal=causal,
                                             scale=scaling, dropout_p=dropout)
        return out.transpose(1, 2).contiguous(), None
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if getattr(module, "_ip_cp_method", "allgather") == "ring" and _PREFILL[0] is None:
        if dropout:
            raise ValueError(f"ring context parallel runs no attention dropout (dropout {dropout})")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = ring_attention(query, key, value, group, scale, window)  # [b, heads, s/cp, d]
        return out.transpose(1, 2).contiguous(), None  # [b, s/cp, heads, d]
    key, value = _whole_sequence(key, group, cp), _whole_sequence(value, group, cp)  # [b, kv_heads, s, d]
    q_pos = local_positions(query.shape[2], cp, rank, query.device)  # [s/cp]
    k_pos = torch.arange(key.shape[2], device=query.device)  # [s]
    mask = q_pos[:, None] >= k_pos[None, :]  # [s/cp, s], causal in global positions
    if window:  # a sliding layer (Mistral, Gemma 3) sees only the last `window` keys, itself included
        mask &= q_pos[:, None] - k_pos[None, :] < window
    if _PREFILL[0] is not None:
        cache, key_mask = _PREFILL[0]
        layer = cache.layers[module.layer_idx]
        layer.keys, layer.values = key, value  # the whole prompt, not the local chunk update() stored
        # Padding keys hidden; every query still sees itself, so a padding query's row is not
        # empty (an empty row is NaN in SDPA, and NaN reaches the real rows through V).
        mask = (mask[None, None] & key_mask[:, None, None, :].bool()) | (q_pos[:, None] == k_pos[None, :])
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)  # [b, heads, s, d]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None  # [b, heads, s/cp, d] -> [b, s/cp, heads, d]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPL, cp_attention)


def apply_cp(model: nn.Module, mesh, spec, method: str = "allgather") -> None:
    """Route every attention module of `model` (FamilyInfo.attention_path in each block) through
    cp_attention over the 1-D cp `mesh`, its K/V exchanged by `method` ('allgather' or 'ring')."""
    _register()
    group = mesh.get_group()
    model.config._attn_implementation = IMPL
    layers = model.get_submodule(spec.family_info.layers_path)
    for layer in layers:
        attn = layer.get_submodule(spec.family_info.attention_path)
        attn._ip_cp_group, attn._ip_cp_method = group, method
        attn.config._attn_implementation = IMPL


@contextlib.contextmanager
def whole_sequence():
    """Run attention on the full local sequence (decoding): no split, no gather."""
    _ENABLED[0] = False
    try:
        yield
    finally:
        _ENABLED[0] = True


@contextlib.contextmanager
def prefill(cache, key_mask: torch.Tensor):
    """A split forward of a prompt whose gathered keys and values fill `cache` (see the module
    docstring); `key_mask` [b, s] (1: a real token) in global order hides the padding."""
    _PREFILL[0] = (cache, key_mask)
    try:
        yield
    finally:
        _PREFILL[0] = None
