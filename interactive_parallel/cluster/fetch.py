"""Any rank's tensor on this client: a parameter's weight, gradient or AdamW state, one rank's
block or the whole tensor put together here.

Owns the refusals made before any rank is touched (an unknown `what`, a rank outside the
session, a parameter name the layout does not list, with the nearest names, a rank that does
not hold the parameter, naming the ranks that do, a whole tensor over the size limit), which
ranks to ask, and assembling a whole tensor from blocks by the index ranges each rank reports
with it (the ShardRecords layout() reports; no collective on the ranks: each sends its own
block, one rank per distinct block). The blocks come from runtime.api.fetch. Knows nothing of
how a layout was made; imports torch only once blocks have arrived.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any

from ..records import TENSOR_KINDS, ShardRecord
from ..runtime import api
from .errors import SessionError
from .model_ops import ModelOps
from .rankset import RankSet

FULL_LIMIT_BYTES = 256 * 2**20
"""The largest whole tensor fetch(full=True) puts together on this client unless told more
(`limit_bytes`): the client holds it whole, beside the blocks it came from."""
ELEMENT_BYTES = 4
"""Weights, gradients and AdamW's states are fp32 under every precision (autocast casts inside
the matmuls), so a whole tensor's size is known from its shape before any rank is asked."""


class FetchError(ValueError):
    """A fetch refused: a bad name, rank or kind, or a whole tensor too large to put together."""


@dataclass
class Fetched:
    """One parameter's tensor as fetched: `tensor` (CPU), and where it came from."""

    name: str
    what: str
    rank: int | None
    """The rank whose block this is (None: the whole tensor, put together from every block)."""
    tensor: Any
    shards: list[ShardRecord]
    """The block's record (placements, mesh coordinates, index ranges of the whole tensor), or,
    for a whole tensor, the record of each block it was put together from."""
    permuted: tuple[int, list[int]] | None = None
    """(dim, permutation) of a weight stored permuted along dim (GPT-2's fused q|k|v under TP):
    a block's index ranges refer to that stored order; a whole tensor is put back in order."""

    shape = property(lambda self: tuple(self.tensor.shape))
    dtype = property(lambda self: self.tensor.dtype)
    placements = property(lambda self: self.shards[0].placements if self.rank is not None else [])
    coords = property(lambda self: self.shards[0].coords if self.rank is not None else {})
    index = property(lambda self: self.shards[0].index if self.rank is not None else
                     [[0, n] for n in self.tensor.shape])

    def stats(self) -> dict[str, float]:
        """norm, min, max, mean of the values (NaN for an empty tensor)."""
        t = self.tensor.detach().float()
        if t.numel() == 0:
            return dict.fromkeys(("norm", "min", "max", "mean"), math.nan)
        return {"norm": float(t.norm()), "min": float(t.min()), "max": float(t.max()), "mean": float(t.mean())}

    def __repr__(self) -> str:
        where = "whole" if self.rank is None else f"rank {self.rank}"
        spans = ", ".join(f"{a}:{b}" for a, b in self.index)
        return (f"<Fetched {self.what} of {self.name}, {where}: shape {self.shape} {self.dtype}, "
                f"placements {self.placements or 'none'}, index [{spans}]>")


def _size(n: int) -> str:
    short = f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"
    return f"{short} ({n:,} bytes)"


def check_args(what: str, rank: Any, world: int) -> None:
    """Refuse an unknown `what` or a rank outside the session (nothing asked of any rank)."""
    if what not in TENSOR_KINDS:
        raise FetchError(f"what={what!r} is not one of {', '.join(TENSOR_KINDS)} (the weight, its gradient, "
                         "or a state AdamW keeps per parameter)")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise FetchError(f"rank {rank!r} is outside this session of {world} ranks (0 .. {world - 1})")


def holders_of(shards: list[ShardRecord], name: str, rank: int, full: bool) -> list[ShardRecord]:
    """The layout's records of `name` this fetch needs: the asked rank's, or for a whole tensor
    the first holder of each distinct block. Refuses a name the layout does not list (naming
    the nearest) and a rank that holds no block of it (naming the ranks that do)."""
    records = [r for r in shards if r.param == name]
    if not records:
        names = sorted({r.param for r in shards})
        near = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
        hint = f"nearest: {', '.join(near)}" if near else f"names look like {', '.join(names[:3])}, ..."
        raise FetchError(f"no parameter {name!r} in the laid-out model ({len(names)} parameters); {hint}")
    if full:
        first: dict[tuple, ShardRecord] = {}
        for r in sorted(records, key=lambda r: r.rank):
            first.setdefault(tuple(map(tuple, r.index)), r)
        return list(first.values())
    mine = [r for r in records if r.rank == rank]
    if not mine:
        ranks = sorted(r.rank for r in records)
        stage = f" it lives in pipeline stage {records[0].stage}," if records[0].stage is not None else ""
        raise FetchError(f"rank {rank} does not hold {name!r}:{stage} held by ranks {ranks}")
    return mine


def check_size(record: ShardRecord, what: str, limit_bytes: int) -> None:
    size = ELEMENT_BYTES * (1 if what == "step" else math.prod(record.global_shape))
    if size > limit_bytes:
        raise FetchError(f"the whole {what} of {record.param} is {_size(size)}, shape {tuple(record.global_shape)} "
                         f"fp32, over the limit of {_size(limit_bytes)} for full=True: fetch one rank's block "
                         "(full=False), or pass limit_bytes= to allow more")


def assemble(pieces: list[tuple], name: str, what: str) -> Any:
    """The whole tensor from (record, block, permutation) of distinct blocks, by their index ranges."""
    import torch

    for rec, _, _ in pieces:
        summed = [f"{a}: {p}" for a, p in zip(rec.mesh_axes, rec.placements) if p.startswith("Partial")]
        if summed:
            raise FetchError(f"rank {rec.rank}'s {what} of {name} is {', '.join(summed)}: its blocks are "
                             "summands, not tiles; fetch each rank's (full=False)")
    rec, block, perm = pieces[0]
    whole = torch.empty(rec.global_shape, dtype=block.dtype)
    covered = torch.zeros(rec.global_shape, dtype=torch.bool)
    for rec, block, _ in pieces:
        at = tuple(slice(a, b) for a, b in rec.index)
        whole[at] = block
        covered[at] = True
    if not bool(covered.all()):
        raise SessionError(f"the blocks of {name}'s {what} from ranks {[p[0].rank for p in pieces]} do not "
                           "cover it: its placements differ from the weight's; fetch each rank's (full=False)")
    if perm is not None:
        whole = whole.index_select(perm[0], torch.argsort(torch.tensor(perm[1]))).contiguous()
    return whole


async def fetch(model: ModelOps, ranks: RankSet, name: str, rank: int, full: bool, what: str,
                limit_bytes: int) -> Fetched:
    """Session.fetch (see its docstring): every refusal first, then the ranks."""
    from . import checks

    model.require_layout()
    checks.refuse_quantized(model.quantization, "fetch")
    check_args(what, rank, ranks.world_size)
    needed = holders_of(list(await model.layout()), name, rank, full)  # the layout: read once per plan
    if full:
        check_size(needed[0], what, limit_bytes)
    asked = sorted(r.rank for r in needed)
    await ranks.require()
    if what == "grad":  # a forward and backward: every rank runs it, the asked ones send
        got = await ranks.call(api.fetch, per_rank=lambda r: ((name, what, r in asked, model.data), {}),
                               what="fetch")
    else:
        got = await ranks.call(api.fetch, (name, what, True, model.data), ranks=asked, what="fetch")
    pieces = [p for p in got if p is not None]
    if not full:
        rec, block, perm = pieces[0]
        return Fetched(name, what, rank, block, [rec], perm)
    return Fetched(name, what, None, assemble(pieces, name, what), [p[0] for p in pieces], pieces[0][2])
