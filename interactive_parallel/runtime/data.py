"""Training data the package makes: two-digit additions, one per line ("12+35=47\\n").

Owns the synthetic task and the deterministic global batch for a (seed, step), so every
rank and the single-process reference see the same tokens and each data-parallel rank
takes its own slice, making only its rows (a dry run makes the batch once for all its
simulated ranks: reuse_batches). Answers can be checked, so generation shows what training
taught.
Knows nothing of parallel layouts beyond "slice i of n".
"""
from __future__ import annotations

import contextlib
import random

import torch

from .tokenizer import get_tokenizer


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


_REUSE: list[dict] = []


@contextlib.contextmanager
def reuse_batches():
    """Within the block global_batch returns one tensor per arguments: a dry run's simulated
    ranks all train on the same batch, and tokenizing a real-size batch takes seconds."""
    _REUSE.append({})
    try:
        yield
    finally:
        _REUSE.pop()


def global_batch(seed: int, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """Token ids of shape (batch_size, seq_len + 1): inputs are [:, :-1], targets [:, 1:]."""
    if _REUSE:
        key = (seed, step, batch_size, seq_len)
        if key not in _REUSE[-1]:
            _REUSE[-1][key] = _make_batch(*key)
        return _REUSE[-1][key]
    return _make_batch(seed, step, batch_size, seq_len)


def _make_batch(seed: int, step: int, batch_size: int, seq_len: int, rows: range | None = None) -> torch.Tensor:
    """Rows `rows` (default: all) of the global batch: each row is seeded by its own index,
    so a slice made alone equals the same slice of the whole."""
    tok = get_tokenizer()
    out = []
    for i in rows if rows is not None else range(batch_size):
        rng = random.Random(hash((seed, step, i)) & 0x7FFFFFFF)
        out.append(tok(text_row(rng, seq_len + 1), add_special_tokens=False)["input_ids"])
    return torch.tensor(out, dtype=torch.long, device="cpu")  # the same on every device; callers move it


def _slice_rows(batch_size: int, index: int, count: int) -> range:
    per = batch_size // count
    return range(index * per, (index + 1) * per)


def local_slice(batch: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Rows of the global batch that data-parallel rank `index` of `count` trains on."""
    rows = _slice_rows(batch.shape[0], index, count)
    return batch[rows.start:rows.stop]


def local_batch(seed: int, step: int, batch_size: int, seq_len: int, index: int, count: int) -> torch.Tensor:
    """local_slice of the global batch, making only those rows (a rank need not tokenize its
    peers' rows every step); within reuse_batches, a copy of the one global batch's slice,
    holding as many bytes as the rows a live rank makes (a dry run's memory matches it)."""
    if _REUSE:
        return local_slice(global_batch(seed, step, batch_size, seq_len), index, count).clone()
    return _make_batch(seed, step, batch_size, seq_len, _slice_rows(batch_size, index, count))
