"""Where a rank's local tensor sits in the logical tensor: a list of rectangular pieces.

Owns one question, asked by the seeded initializer (runtime.layout.initialize) and by the
checkpoint code (runtime.checkpoints.checkpoint): which index ranges of the logical tensor (the
transformers checkpoint layout, the same under every plan) does this rank's local
tensor hold, and which view of the local tensor holds each. A plain tensor is one piece
(the whole). A DTensor's local shard is one contiguous block of its global tensor
(torch's `compute_local_shape_and_global_offset`, which DCP uses too; it knows FSDP's
strided shards over a TP-sharded dim). A tensor stored permuted along one dim (GPT-2's
fused q|k|v under TP, `Parallelized.perms`) holds runs of the logical dim that are
contiguous locally but not globally: one piece per run.

`Pieces` presents such a tensor to torch.distributed.checkpoint (DCP) through the hooks
DTensor itself implements (`__create_write_items__`, `__create_chunk_list__`), so DCP
writes each piece at its logical offsets and reshards on load as it does for DTensors.
Knows nothing of models, plans or optimizers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Piece:
    """`view` (a view of the local tensor) holds logical[offsets[d] : offsets[d] + view.shape[d]]."""

    offsets: tuple[int, ...]
    view: torch.Tensor

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.view.shape)


def local_block(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(local tensor, its offsets in the global tensor): the whole for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t._local_tensor  # FSDP2's unpadded view; to_local() would be a new alias each call
        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return local, tuple(int(o) for o in offsets) if offsets else (0,) * t.dim()
    return t, (0,) * t.dim()


def _runs(values: list[int]) -> list[tuple[int, int, int]]:
    """(local start, logical start, length) of each maximal run of consecutive logical indices."""
    out: list[tuple[int, int, int]] = []
    for i, v in enumerate(values):
        if out and out[-1][1] + out[-1][2] == v:
            start, logical, n = out[-1]
            out[-1] = (start, logical, n + 1)
        else:
            out.append((i, v, 1))
    return out


def pieces(t: torch.Tensor, perm: tuple[int, torch.Tensor] | None = None) -> list[Piece]:
    """The pieces of `t`'s local tensor; `perm` = (dim, permutation) when `t` is stored permuted
    (stored index i along dim holds logical index permutation[i])."""
    local, offsets = local_block(t)
    if perm is None or local.dim() <= perm[0]:
        return [Piece(offsets, local)]
    dim, permutation = perm
    start = offsets[dim]
    logical = permutation[start:start + local.shape[dim]].tolist()
    out = []
    for at, first, n in _runs(logical):
        o = list(offsets)
        o[dim] = first
        out.append(Piece(tuple(o), local.narrow(dim, at, n)))
    return out


class Pieces:
    """A logical tensor of which this rank holds `parts` (DCP's checkpointable protocol)."""

    def __init__(self, size: torch.Size, parts: list[Piece]):
        self._size = torch.Size(size)
        self.parts = parts
        self.dtype = parts[0].view.dtype if parts else torch.float32

    @classmethod
    def of(cls, t: torch.Tensor, perm: tuple[int, torch.Tensor]) -> "Pieces":
        return cls(t.shape, pieces(t, perm))

    def size(self) -> torch.Size:
        return self._size

    def _chunk(self, piece: Piece):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=torch.Size(piece.sizes))

    def __create_write_items__(self, fqn: str, _obj) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(self.parts[0].view)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(p.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._chunk(p), properties=props, size=self._size))
                for p in self.parts]

    def __create_chunk_list__(self) -> list:
        return [self._chunk(p) for p in self.parts]

    def view_at(self, offsets) -> torch.Tensor:
        for p in self.parts:
            if tuple(p.offsets) == tuple(offsets):
                return p.view
        raise KeyError(f"no piece at offsets {tuple(offsets)}")
