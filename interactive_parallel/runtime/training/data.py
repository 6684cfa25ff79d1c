"""Training data: the package's two-digit additions ("12+35=47\\n") or the user's own text.

Owns the deterministic global batch for a (seed, step), so every rank and the
single-process reference see the same tokens and each data-parallel rank takes its own
slice, making only its rows (a dry run makes the batch once for all its simulated ranks:
reuse_batches). Two sources, each in the model's tokenizer's ids:
- the synthetic task (the default): answers can be checked, so generation shows what
  training taught; a row is seeded by its own index;
- the user's text, a DataSource the client checked (`reading` names it for the call): its
  documents tokenized once per (file, tokenizer) and kept in memory, joined with the
  end-of-sequence token between them and cut into rows of seq_len + 1 tokens; the global
  batch of a step is the next batch_size rows of a seeded permutation of all rows per epoch.
Knows nothing of parallel layouts beyond "slice i of n", nor of where the text came from.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
from functools import lru_cache
from typing import Iterator

import torch

from ...records import DataSource
from ..model.tokenizer import get_tokenizer, one_per_character


def problem(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(100), rng.randrange(100)
    return f"{a}+{b}=", str(a + b)


def text_row(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    length = 0
    while length < n_chars:
        q, a = problem(rng)
        out.append(f"{q}{a}\n")
        length += len(out[-1])
    return "".join(out)[:n_chars]


def arithmetic_ids(rng: random.Random, n: int, tok) -> list[int]:
    """`n` token ids of additions from `rng`: the package's tokenizer makes one per character;
    another tokenizer takes whole lines until it has made `n`."""
    if one_per_character(tok):
        return tok(text_row(rng, n), add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    while len(ids) < n:
        lines = ["".join(problem(rng)) + "\n" for _ in range(8)]
        for row in tok(lines, add_special_tokens=False)["input_ids"]:
            ids += row
    return ids[:n]


_REUSE: list[dict] = []
_READING: list[DataSource | None] = []


@contextlib.contextmanager
def reading(source: DataSource | None):
    """Within the block the batches come from `source`'s text (None: the synthetic task):
    the train or verify call that reads it says so once, around its loop."""
    _READING.append(source)
    try:
        yield
    finally:
        _READING.pop()


def current_source() -> DataSource | None:
    """The text the running call reads (None: the synthetic task)."""
    return _READING[-1] if _READING else None


@contextlib.contextmanager
def reuse_batches():
    """Within the block global_batch returns one tensor per arguments: a dry run's simulated
    ranks all train on the same batch, and tokenizing a real-size batch takes seconds."""
    _REUSE.append({})
    try:
        yield
    finally:
        _REUSE.pop()


def global_batch(seed: int, step: int, batch_size: int, seq_len: int, *, tok=None,
                 source: DataSource | None = None) -> torch.Tensor:
    """Token ids of shape (batch_size, seq_len + 1): inputs are [:, :-1], targets [:, 1:].
    `tok`: the model's tokenizer (default the package's); `source`: the user's text (default
    the synthetic task)."""
    tok = get_tokenizer() if tok is None else tok
    if _REUSE:
        key = (seed, step, batch_size, seq_len, id(tok), source)
        if key not in _REUSE[-1]:
            _REUSE[-1][key] = _make(seed, step, batch_size, seq_len, tok, source)
        return _REUSE[-1][key]
    return _make(seed, step, batch_size, seq_len, tok, source)


def _make(seed: int, step: int, batch_size: int, seq_len: int, tok, source: DataSource | None,
          rows: range | None = None) -> torch.Tensor:
    if source is not None:
        return text_batch(source, tok, seed, step, batch_size, seq_len, rows)
    return _make_batch(seed, step, batch_size, seq_len, rows, tok)


def _make_batch(seed: int, step: int, batch_size: int, seq_len: int, rows: range | None = None,
                tok=None) -> torch.Tensor:
    """Rows `rows` (default: all) of the synthetic global batch: each row is seeded by its own
    index, so a slice made alone equals the same slice of the whole."""
    tok = get_tokenizer() if tok is None else tok
    out = []
    for i in rows if rows is not None else range(batch_size):
        rng = random.Random(hash((seed, step, i)) & 0x7FFFFFFF)
        out.append(arithmetic_ids(rng, seq_len + 1, tok))
    return torch.tensor(out, dtype=torch.long, device="cpu")  # the same on every device; callers move it


def _slice_rows(batch_size: int, index: int, count: int) -> range:
    per = batch_size // count
    return range(index * per, (index + 1) * per)


def local_slice(batch: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Rows of the global batch that data-parallel rank `index` of `count` trains on."""
    rows = _slice_rows(batch.shape[0], index, count)
    return batch[rows.start:rows.stop]


def local_batch(seed: int, step: int, batch_size: int, seq_len: int, index: int, count: int, *, tok=None,
                source: DataSource | None = None) -> torch.Tensor:
    """local_slice of the global batch, making only those rows (a rank need not tokenize its
    peers' rows every step); within reuse_batches, a copy of the one global batch's slice,
    holding as many bytes as the rows a live rank makes (a dry run's memory matches it)."""
    tok = get_tokenizer() if tok is None else tok
    if _REUSE:
        return local_slice(global_batch(seed, step, batch_size, seq_len, tok=tok, source=source), index,
                           count).clone()
    return _make(seed, step, batch_size, seq_len, tok, source, _slice_rows(batch_size, index, count))


# ---- the user's text -------------------------------------------------------------------------------

_TOKENS: dict[tuple, tuple[object, torch.Tensor]] = {}
"""(path, format, mtime, size, tokenizer id) -> (that tokenizer, the text's ids): the tokenizer is
held so its id names no other while the entry lives."""
_KEEP = 4
"""Token tensors kept (per file version and tokenizer): a session switches between a few texts."""


def documents(source: DataSource) -> Iterator[str]:
    """The texts of `source`: a text file is one document, a .jsonl line or a data set row another."""
    if source.format == "text":
        with open(source.path, encoding="utf-8") as f:
            yield f.read()
    elif source.format == "jsonl":
        with open(source.path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    text = row.get("text") if isinstance(row, dict) else None
                    if not isinstance(text, str):
                        raise ValueError(f"{source.path} line {n}: no 'text' string")
                    yield text
    elif source.format == "datasets":
        yield from _dataset_texts(source.path)
    else:
        raise ValueError(f"{source.path}: unknown data format {source.format!r}")


def _dataset_texts(path: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path} was written by datasets' save_to_disk, and the datasets package is not "
                         "installed on this rank") from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds and len(ds) != 1:
            raise ValueError(f"{path} holds splits {sorted(ds)} and none is 'train'")
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    if "text" not in ds.column_names:
        raise ValueError(f"{path} has no 'text' column (columns: {', '.join(ds.column_names)})")
    for start in range(0, len(ds), 1024):
        yield from (t for t in ds[start:start + 1024]["text"] if isinstance(t, str))  # a missing value is no text


def token_ids(source: DataSource, tok) -> torch.Tensor:
    """Every document of `source` in `tok`'s ids (with the special tokens the tokenizer itself
    adds), the end-of-sequence token between two: 1-D, tokenized once per file version and
    tokenizer in this process."""
    st = os.stat(source.path)
    key = (source.path, source.format, st.st_mtime_ns, st.st_size, id(tok))
    if key not in _TOKENS:
        while len(_TOKENS) >= _KEEP:
            _TOKENS.pop(next(iter(_TOKENS)))
        _TOKENS[key] = (tok, _tokenize(documents(source), tok))
    return _TOKENS[key][1]


def _tokenize(docs: Iterator[str], tok) -> torch.Tensor:
    dtype = torch.int32 if len(tok) < 2**31 else torch.long  # half the bytes of the ids kept
    eos = tok.eos_token_id
    parts: list[torch.Tensor] = []
    batch: list[str] = []

    def flush() -> None:
        for ids in tok(batch, verbose=False)["input_ids"]:
            if parts and eos is not None:
                parts.append(torch.tensor([eos], dtype=dtype))
            parts.append(torch.tensor(ids, dtype=dtype))
        batch.clear()

    for doc in docs:
        batch.append(doc)
        if len(batch) == 256:
            flush()
    if batch:
        flush()
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def text_batch(source: DataSource, tok, seed: int, step: int, batch_size: int, seq_len: int,
               rows: range | None = None) -> torch.Tensor:
    """Rows `rows` (default: all) of the global batch of `step` from `source`'s text.

    The text's rows of seq_len + 1 tokens are read in the order of one seeded permutation per
    epoch, a batch after the previous one (a batch may straddle two epochs), so the batch of a
    step does not depend on what was read before it, nor a slice made alone on the others.
    """
    ids = token_ids(source, tok)
    n_rows = ids.numel() // (seq_len + 1)
    if n_rows < batch_size:
        raise ValueError(f"{source.path} holds {ids.numel()} tokens: fewer than one batch of batch_size({batch_size}) "
                         f"x (seq_len({seq_len}) + 1) = {batch_size * (seq_len + 1)} tokens")
    table = ids[:n_rows * (seq_len + 1)].view(n_rows, seq_len + 1)
    picked = []
    for i in rows if rows is not None else range(batch_size):
        epoch, offset = divmod(step * batch_size + i, n_rows)
        picked.append(int(_order(seed, epoch, n_rows)[offset]))
    return table[picked].long()


@lru_cache(maxsize=4)
def _order(seed: int, epoch: int, n_rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash((seed, epoch)) & 0x7FFFFFFF)
    return torch.randperm(n_rows, generator=gen)
