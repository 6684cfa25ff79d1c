"""One parameter's tensor on this rank, for the client to look at (Session.fetch): the weight, its
gradient or a state AdamW keeps for it, as a CPU copy of this rank's local block beside the
ShardRecord that says where the block sits (runtime.probes.layout: the ranges layout() reports).

Owns reading those tensors and one fact about gradients: a training step frees them
(`zero_grad(set_to_none=True)` ends it), so none survives a train call. A gradient is computed
here as verify computes its own: one forward and backward of the current step's batch on the
current weights, no optimizer step (a collective: every rank runs it), freed again after: the
gradient the next step will apply. Knows nothing of the client, nor of putting the blocks of
several ranks together (the client does, from the records).
"""
from __future__ import annotations

from typing import Any

import torch

from ...records import ShardRecord
from ..probes.layout import shard_record
from .train import forward_backward, local_batch
from .verify import zero_grads

Piece = tuple[ShardRecord, torch.Tensor, Any]
"""(where the block sits, the block as a CPU copy, (dim, permutation) of a weight stored permuted
along dim (GPT-2's fused q|k|v under TP: `Parallelized.perms`) or None)."""


def _held(par, name: str):
    """The parameter `name` as this rank holds it, or None (a pipeline stage it does not run)."""
    if name not in set(par.owned_keys()):
        return None
    return dict(par.raw.named_parameters()).get(name)


def _gradient(st, p, name: str) -> torch.Tensor | None:
    """`p`'s gradient of the current step's batch on the current weights (every rank must call)."""
    par = st.parallel
    zero_grads(par)
    try:
        forward_backward(par, local_batch(par, st.step))
        grad = None if p is None else p.grad
    finally:
        zero_grads(par)
    if p is not None and grad is None:
        raise LookupError(f"rank {st.rank}: {name} got no gradient from a forward and backward of step "
                          f"{st.step}'s batch: the loss does not depend on it")
    return grad


def _state(st, p, name: str, what: str) -> torch.Tensor:
    state = st.optimizer.state.get(p) if st.optimizer is not None else None
    if not state:
        raise LookupError(f"rank {st.rank}: AdamW holds no state for {name} yet: it creates it at the first "
                          "optimizer step (train a step first)")
    if what not in state:
        raise LookupError(f"rank {st.rank}: AdamW holds {sorted(state)} for {name}, not {what!r}")
    return state[what]


def local_piece(st, name: str, what: str, send: bool = True) -> Piece | None:
    """This rank's block of `what` ('param', 'grad' or an AdamW state name) of parameter `name`,
    or None when this rank does not hold it or `send` is False (a rank that only joins the
    collective a gradient needs)."""
    par = st.parallel
    p = _held(par, name)
    if what == "grad":
        t = _gradient(st, p, name)
    elif p is None:
        return None
    else:
        t = p if what == "param" else _state(st, p, name, what)
    if p is None or not send:
        return None
    record = shard_record(par, st.rank, name, t)
    local = t._local_tensor if hasattr(t, "_local_tensor") else t  # FSDP2's unpadded block
    block = local.detach().to("cpu", copy=True)
    perm = par.perms.get(name) if what != "step" else None
    return record, block, None if perm is None else (int(perm[0]), [int(i) for i in perm[1].tolist()])
