"""The load-balanced sequence split of context parallelism, which both of its attentions share.

Owns which tokens a cp rank keeps: the sequence cut into 2*cp chunks, rank r keeping chunks r
and 2*cp-1-r, so under a causal mask every rank does the same amount of attention work, and
their global positions. Knows nothing of attention, of process groups or of the model.
"""
from __future__ import annotations

import torch


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Chunks r and 2*cp-1-r of `t` along `dim` (validation makes seq_len divisible by 2*cp)."""
    chunks = t.chunk(2 * cp, dim=dim)  # 2cp x [.., s/2cp, ..]
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)  # [.., s/cp, ..]


def local_positions(seq_local: int, cp: int, rank: int, device) -> torch.Tensor:
    """Global positions of this rank's tokens: chunks r and 2*cp-1-r of the sequence, [s/cp]."""
    c = seq_local // 2
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])
