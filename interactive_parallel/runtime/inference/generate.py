"""Text generation on this rank: KV-cached, greedy or sampled, batched prompts of any lengths.

Owns the decoding loop: one forward over the left-padded prompts (prefill), then one
forward per new token that feeds only that token, the earlier ones living in transformers'
cache (runtime.inference.decode runs the forward under each layout and keeps the cache). Every rank
runs the same number of steps (decoding stops early only when the ranks agree, through
the caller's `on_step`) so that ranks whose forward is a collective stay in lockstep; text
is cut at the end-of-sequence token afterwards. The text is the model's own tokenizer's
(runtime.model.tokenizer.tokenizer_for: a model directory's, else the package's), and the
vocabulary's padding rows (ids that tokenizer never makes) are never chosen. Sampling draws
from a generator seeded the same on every rank, and every rank gets the same logits, so
tensor- and pipeline-parallel ranks agree on each token. Knows nothing of layouts,
streaming or records' transport.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...records import DecodeStep
from ..layout.parallelized import Parallelized
from ..model.tokenizer import get_tokenizer, one_per_character, text_added, tokenizer_for
from .decode import cache_bytes, decoding, forward_last, measured, new_caches

OnStep = Callable[[int, list[str], list[bool], DecodeStep], bool]


def pick(logits: torch.Tensor, *, do_sample: bool, temperature: float, top_k: int,
         generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [b, 1] from float logits [b, vocab] (padding rows already at -inf)."""
    if not do_sample:
        return logits.argmax(-1, keepdim=True)
    logits = logits / max(temperature, 1e-5)
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


def suppress_padding(logits: torch.Tensor, tok=None) -> torch.Tensor:
    """The embedding's padding rows (ids past the tokenizer's vocabulary) are never text."""
    logits[:, len(get_tokenizer() if tok is None else tok):] = float("-inf")
    return logits


def encode(prompts: list[str], device, tok=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask [b, s] of `prompts` (`tok`: default the package's),
    with the special tokens the tokenizer itself adds (a beginning-of-sequence token, for many)."""
    # Left, whatever side the tokenizer pads on: every row's next token follows its last column.
    enc = (get_tokenizer() if tok is None else tok)(prompts, padding=True, padding_side="left", return_tensors="pt")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def generate(par: Parallelized, prompts: list[str], max_new_tokens: int, **kw) -> list[str]:
    """Completions of `prompts`, cut at their end-of-sequence token (see generate_ids)."""
    return decode_new(generate_ids(par, prompts, max_new_tokens, **kw), tokenizer_for(par.spec)) if prompts else []


def generate_ids(par: Parallelized, prompts: list[str], max_new_tokens: int, *, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, seed: int = 0, rank: int = 0,
                 on_step: OnStep | None = None) -> torch.Tensor:
    """New token ids [b, steps] of `prompts`. After each decoding step `on_step(position,
    new_text, done, step)` gets each row's new text, whether each row has finished and the
    step's DecodeStep; returning True stops decoding there (every rank must return the same:
    the caller agrees on it with its peers)."""
    with decoding(par):
        return _generate_ids(par, prompts, max_new_tokens, do_sample, temperature, top_k, seed, rank, on_step)


def _generate_ids(par, prompts, max_new_tokens, do_sample, temperature, top_k, seed, rank, on_step) -> torch.Tensor:
    tok = tokenizer_for(par.spec)
    ids, mask = encode(prompts, par.device, tok)
    gen = torch.Generator(device=par.device).manual_seed(seed)
    caches = new_caches(par, len(prompts))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    new = torch.empty(len(prompts), 0, dtype=ids.dtype, device=ids.device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=ids.device)
    step_ids = ids
    was_training = par.model.training
    par.model.eval()
    try:
        for position in range(max_new_tokens):
            with measured(par, rank, position) as cost:
                logits = suppress_padding(forward_last(par, step_ids, mask, positions, caches), tok)
                nxt = pick(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, generator=gen)
            live = int((~done).sum())
            new = torch.cat([new, nxt], 1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            positions, step_ids = positions[:, -1:] + 1, nxt
            if on_step is None:
                done |= nxt[:, 0] == tok.eos_token_id
                continue
            # A token's text may depend on the tokens before it, except under the package's tokenizer
            rows = nxt.tolist() if one_per_character(tok) else new.tolist()
            last = position == max_new_tokens - 1
            pieces = [text_added(tok, row, final=last or row[-1] == tok.eos_token_id) if not d else ""
                      for row, d in zip(rows, done.tolist())]
            done |= nxt[:, 0] == tok.eos_token_id
            record = DecodeStep(rank=rank, step=position, phase="decode" if position else "prefill",
                                start=cost.start, time_s=cost.time_s, tokens=live, running=len(prompts),
                                kv_bytes=cache_bytes(caches), comm_s=cost.comm_s, comm_bytes=cost.comm_bytes,
                                comm_ops=cost.comm_ops, engine="generate")
            finished = [bool(d) or position == max_new_tokens - 1 for d in done.tolist()]
            if on_step(position, pieces, finished, record):
                break
    finally:
        par.model.train(was_training)
    return new


def decode_new(new_ids: torch.Tensor, tok=None) -> list[str]:
    """Text of each row of generated ids, cut at its end-of-sequence token (`tok`: default the package's)."""
    tok = get_tokenizer() if tok is None else tok
    out = []
    for row in new_ids.tolist():
        if tok.eos_token_id in row:
            row = row[:row.index(tok.eos_token_id)]
        out.append(tok.decode(row, skip_special_tokens=True))
    return out
