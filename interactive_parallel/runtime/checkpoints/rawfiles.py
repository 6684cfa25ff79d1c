"""A torch.distributed.checkpoint storage for the session's scratch state: raw tensor bytes.

Owns how re-plans and recovery snapshots lay their bytes on disk (tmpfs): one file per
rank holding each tensor's bytes as they are in memory, located by (file, offset,
length) in DCP's own metadata, which still describes every chunk, so DCP plans, dedups
and reshards exactly as with its FileSystemWriter/Reader (this only replaces their
`write_data` / `read_data`). Why not those: they wrap every tensor in its own torch.save
zip archive, and for the many small tensors of a tiny model's weights and AdamW state
the archives, not the bytes, were most of a re-plan's time (bench/bench_state.py times
re-plans). Checkpoints the user keeps
(Session.save, export_script) use DCP's standard files; these are only read back by
this module. Knows nothing of models or plans.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future


@dataclass(frozen=True)
class Entry:
    """Where one written item's bytes are: a file of the checkpoint directory and a byte range."""

    file: str
    offset: int
    length: int


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


class RawWriter(FileSystemWriter):
    """FileSystemWriter writing each rank's items as raw bytes into one file."""

    def write_data(self, plan, planner) -> Future:
        name = f"{plan.storage_data.prefix}raw"
        results = []
        with open(os.path.join(self.path, name), "wb") as f:
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = f.tell()
                f.write(data.getbuffer() if item.type == WriteItemType.BYTE_IO else _raw(data))
                length = f.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=Entry(name, offset, length)))
        fut: Future = Future()
        fut.set_result(results)
        return fut


class RawReader(FileSystemReader):
    """FileSystemReader of RawWriter's files."""

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._tensors = metadata.state_dict_metadata

    def _chunk(self, index):
        chunks = self._tensors[index.fqn].chunks
        if index.index is not None and index.index < len(chunks) and chunks[index.index].offsets == index.offset:
            return chunks[index.index]
        return next(c for c in chunks if c.offsets == index.offset)

    def read_data(self, plan, planner) -> Future:
        by_file: dict[str, list] = {}
        for req in plan.items:
            by_file.setdefault(self.storage_data[req.storage_index].file, []).append(req)
        for name, reqs in by_file.items():
            with open(os.path.join(self.path, name), "rb") as f:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    entry = self.storage_data[req.storage_index]
                    f.seek(entry.offset)
                    blob = bytearray(f.read(entry.length))
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(blob))
                        continue
                    dtype = self._tensors[req.storage_index.fqn].properties.dtype
                    sizes = self._chunk(req.storage_index).sizes
                    stored = torch.frombuffer(blob, dtype=dtype).view(sizes) if blob else torch.empty(sizes, dtype=dtype, device="cpu")
                    part = stored[tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))]
                    target = planner.resolve_tensor(req).detach()
                    target.copy_(part)
                    planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut


class PartsReader(RawReader):
    """Several RawWriter directories, each one rank's own shards saved alone (DCP's no_dist),
    read as one checkpoint, so that a layout of another plan loads from them with DCP's own
    load planner (resharding) and no collective.

    DCP writes a checkpoint's global metadata only through its collective planning (with
    `use_collectives=False` it writes each rank's own metadata, read back by that rank
    alone), which is most of a small model's re-plan on CPU ranks: this merges the parts'
    metadata instead. Every chunk is described by its offsets in the logical tensor, so
    the union of the parts' chunks is the tensor; a chunk several parts hold (replicated
    state) is read from the first of them.
    """

    def __init__(self, path: str, parts: list[str]):
        super().__init__(path)
        self.parts = list(parts)
        self._merged = None

    def read_metadata(self, *args, **kwargs):
        if self._merged is None:  # asked by the caller, then by DCP's load: read the parts once
            self._merged = self._merge()
        return self._merged

    def _merge(self):
        import dataclasses

        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

        merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
        for part in self.parts:
            md = RawReader(os.path.join(self.path, part)).read_metadata()
            for fqn, meta in md.state_dict_metadata.items():
                have = merged.state_dict_metadata.get(fqn)
                if have is None:
                    merged.state_dict_metadata[fqn] = dataclasses.replace(meta, chunks=list(meta.chunks)) \
                        if isinstance(meta, TensorStorageMetadata) else meta
                elif isinstance(meta, TensorStorageMetadata):
                    known = {tuple(c.offsets) for c in have.chunks}
                    have.chunks.extend(c for c in meta.chunks if tuple(c.offsets) not in known)
            for index, entry in md.storage_data.items():
                if index not in merged.storage_data:
                    merged.storage_data[index] = Entry(os.path.join(part, entry.file), entry.offset, entry.length)
            merged.planner_data.update(md.planner_data or {})
        merged.storage_meta = StorageMeta()
        merged.storage_meta.load_id = self.load_id
        return merged
