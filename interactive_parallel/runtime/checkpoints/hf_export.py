"""A laid-out model written back as a transformers directory: what `from_pretrained` loads.

Owns the files of that directory and how the ranks write them: `config.json` (the spec's
config as transformers writes it), `generation_config.json` (the model directory's own,
else one from the config that never picks ids past the tokenizer, as Session.generate
never does), the weights as safetensors under the transformers names (a tied LM head
absent, as transformers leaves it out), split into files of at most `max_shard_size`
bytes in the state dict's order with `model.safetensors.index.json` beside them exactly
when there are several (huggingface_hub's split, the one transformers' save_pretrained
uses), and the tokenizer (runtime.model.tokenizer.tokenizer_for: the model directory's own,
else the package's).

The weights go through torch.distributed.checkpoint's HuggingFaceStorageWriter: every
rank writes the pieces it holds, in the logical layout (runtime.layout.pieces: a fused q|k|v
stored permuted under TP goes as its runs; replicas deduplicated by DCP's planner), as
safetensors files with their offsets under `sharded/`; torch's consolidation
(`consolidate_safetensors_files_on_every_rank`) then merges them into the final files,
each output file by one rank, one whole tensor at a time. No rank gathers the model.
Our own code where torch's does not run under our plans (`_PartWriter.write_data`):
torch's writer puts all of a rank's pieces of one output file into one safetensors file
keyed by tensor name, so a rank holding several pieces of one tensor (GPT-2's c_attn under
TP) would keep only the last, and it serializes each such file whole in memory (about
twice its bytes). Ours spreads the pieces over files of bounded size with no name twice
in a file; the consolidation reads every file in the folder whatever its name. Rank 0
then names a single output file `model.safetensors` with no index, as transformers does.

Knows nothing of the client, of checkpoint manifests or of whose the path is: the caller
hands a staging directory and moves it into place.
"""
from __future__ import annotations

import math
import os
import queue
import shutil
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
# Not exported by torch (its writer's own merge, in `finish`, runs on rank 0 alone): a torch
# upgrade may move it.
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

from ...records import SaveInfo
from ..layout.parallelized import Parallelized
from ..model.models import make_config
from ..model.tokenizer import tokenizer_for
from .checkpoint import _planners, live_state

PIECES_DIR = "sharded"
"""Under the staging directory: every rank's pieces, removed once merged (torch's name)."""
SINGLE_FILE = "model.safetensors"
ONE_OF_ONE = "model-00001-of-00001.safetensors"
"""What torch's consolidation names a single output file (transformers: SINGLE_FILE, no index)."""
INDEX_FILE = "model.safetensors.index.json"
PART_FLOOR = 64 * 2**20
"""Bytes a rank's piece file may hold at least (see part_bytes)."""


def save_pretrained(par: Parallelized, path: str, max_shard_size: int, step: int) -> SaveInfo:
    """Write `par`'s model as a transformers directory at `path` (a collective): weights in
    files of at most `max_shard_size` bytes (a tensor larger than that alone in its own),
    config, generation config and tokenizer."""
    logical = logical_tensors(par)
    index = shard_index(logical, max_shard_size)
    state = {name[len("model."):]: t for name, t in live_state(par, None, with_optim=False)[0].items()}
    pieces = os.path.join(path, PIECES_DIR)
    save_planner, _ = _planners()
    dcp.save(state, storage_writer=_PartWriter(pieces, part_bytes(logical)), planner=save_planner())
    consolidate_safetensors_files_on_every_rank(pieces, path, index)  # ends with a barrier: every file merged
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        shutil.rmtree(pieces)
        if max(index.values()) == 1:
            os.replace(os.path.join(path, ONE_OF_ONE), os.path.join(path, SINGLE_FILE))
            os.remove(os.path.join(path, INDEX_FILE))
        write_metadata(par, path, next(t.dtype for t in logical.values() if t.is_floating_point()))
    return SaveInfo(path=path, tensors=len(index), optimizer=False, step=int(step), plan=par.plan.describe())


def logical_tensors(par: Parallelized) -> dict[str, torch.Tensor]:
    """Every tensor the directory holds, in the state dict's order, under its transformers name
    (a tied head under the embedding's): global shapes and dtypes, every stage's (the other
    stages' on the meta device), the same on every rank."""
    out: dict[str, torch.Tensor] = {}
    for name, t in par.raw.state_dict().items():
        out.setdefault(par.canonical(name), t)
    return out


def shard_index(logical: dict[str, torch.Tensor], max_shard_size: int) -> dict[str, int]:
    """Tensor name -> its output file (1..N), split as transformers' save_pretrained splits."""
    from huggingface_hub import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(logical, get_storage_size=_nbytes, max_shard_size=max_shard_size,
                                                 filename_pattern="model{suffix}.safetensors")
    files = {name: i for i, name in enumerate(split.filename_to_tensors, start=1)}
    return {name: files[split.tensor_to_filename[name]] for name in logical}


def part_bytes(logical: dict[str, torch.Tensor]) -> int:
    """The most bytes of pieces one rank's file holds: the largest tensor's, so that serializing
    a file costs about what holding one whole tensor does (the consolidation holds one at a
    time too); at least PART_FLOOR, so a small model is not written as many tiny files."""
    return max(PART_FLOOR, max(_nbytes(t) for t in logical.values()))


def _nbytes(t: torch.Tensor) -> int:
    return math.prod(t.shape) * t.dtype.itemsize


def write_metadata(par: Parallelized, path: str, dtype: torch.dtype) -> None:
    """config.json, generation_config.json and the tokenizer's files, as transformers writes them."""
    from transformers import GenerationConfig

    spec = par.spec
    config = make_config(spec)
    # As transformers' save_pretrained records them: pipelines read the class, dtype='auto' the dtype.
    config.architectures = [type(par.raw).__name__]
    config.dtype = dtype
    config.save_pretrained(path)
    tok = tokenizer_for(spec)
    tok.save_pretrained(path)
    source = spec.source
    if source and os.path.isfile(os.path.join(source, "generation_config.json")):
        generation = GenerationConfig.from_pretrained(source)
    else:
        generation = GenerationConfig.from_model_config(config)
        if len(tok) < spec.vocab_size:  # the embedding's padding rows: ids the tokenizer never makes
            generation.suppress_tokens = list(range(len(tok), spec.vocab_size))
    generation.save_pretrained(path)


def _parts(items: list, limit: int) -> list[list]:
    """`items` (DCP WriteItems) in files of at most `limit` bytes (a larger item alone in its
    own), no tensor name twice in one file; first fit, in the plan's order."""
    files: list[_Part] = []
    for item in items:
        size = math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
        home = next((f for f in files if item.index.fqn not in f.names and f.size + size <= limit), None)
        if home is None:
            home = _Part()
            files.append(home)
        home.size += size
        home.names.add(item.index.fqn)
        home.items.append(item)
    return [f.items for f in files]


@dataclass
class _Part:
    size: int = 0
    names: set = field(default_factory=set)
    items: list = field(default_factory=list)


class _PartWriter(HuggingFaceStorageWriter):
    """torch's HuggingFaceStorageWriter, each rank's pieces in files of at most `part_bytes`
    with no tensor name twice in a file (see the module docstring); merged afterwards by
    the caller, not in `finish` (which would merge every file on rank 0 alone)."""

    def __init__(self, path: str, part_bytes: int):
        super().__init__(path, save_distributed=True, enable_consolidation=False)
        self.part_bytes = part_bytes
        self.sync_files = False  # the pieces are read once and removed; the merged files are the output

    def write_data(self, plan, planner):
        files: queue.Queue = queue.Queue()
        shard = plan.storage_data["shard_index"]
        for k, items in enumerate(_parts(plan.items, self.part_bytes)):
            name = f"shard-{shard:05d}-part-{k:05d}.safetensors"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)
