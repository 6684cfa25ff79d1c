"""Text generation on this rank: greedy or sampled, batched prompts, no KV cache.

Owns the decoding loop. Every rank runs max_new_tokens forward passes (no early stop at
end-of-sequence; only when the caller's `on_step`, agreed across ranks, says so) so that
ranks whose forward is a collective stay in lockstep; text is cut at the end-of-sequence
token afterwards. Sampling draws from a generator seeded the same on
every rank, so tensor-parallel ranks agree on each token. Knows nothing of layouts:
Parallelized.forward_logits returns full logits on every rank (under PP the last stage
broadcasts them; stages are run with plain send/recv because a PipelineStage cannot
change its sequence length), so every rank builds the same completions.
"""
from __future__ import annotations

from typing import Callable

import torch

from .parallelized import Parallelized
from .tokenizer import get_tokenizer


@torch.no_grad()
def generate(par: Parallelized, prompts: list[str], max_new_tokens: int, *, do_sample: bool = False,
             temperature: float = 1.0, top_k: int = 0, seed: int = 0,
             on_step: Callable[[int, list[str], list[bool]], bool] | None = None) -> list[str]:
    """Completions of `prompts`. After each decoding step `on_step(position, new_text, done)` gets
    each row's new text and whether the row has finished; returning True stops decoding there
    (every rank must return the same: the caller agrees on it with its peers)."""
    tok = get_tokenizer()
    if not prompts:
        return []
    enc = tok(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    ids, mask = enc["input_ids"].to(par.device), enc["attention_mask"].to(par.device)
    gen = torch.Generator(device=par.device).manual_seed(seed)
    prompt_len = ids.shape[1]
    shown = [""] * len(prompts)
    par.model.eval()
    try:
        for position in range(max_new_tokens):
            step_ids, step_mask = _pad_for_layout(par, ids, mask)
            position_ids = (step_mask.cumsum(-1) - 1).clamp(min=0)
            logits = par.forward_logits(step_ids, attention_mask=step_mask,
                                        position_ids=position_ids)[:, -1, :].float()
            logits[:, len(tok):] = float("-inf")  # padding rows of the embedding are never text
            if do_sample:
                logits = logits / max(temperature, 1e-5)
                if top_k:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            if on_step is not None:
                texts = _decode(tok, ids[:, prompt_len:])
                done = [tok.eos_token_id in row for row in ids[:, prompt_len:].tolist()]
                done = [d or position == max_new_tokens - 1 for d in done]
                pieces = [t[len(p):] for t, p in zip(texts, shown)]
                shown = texts
                if on_step(position, pieces, done):
                    break
    finally:
        par.model.train()
    return _decode(tok, ids[:, prompt_len:])


def _pad_for_layout(par: Parallelized, ids: torch.Tensor, mask: torch.Tensor):
    """Left-pad so sequence-parallel layers can cut the sequence evenly over tp ranks.

    Padding is masked out and positions come from the mask, so the logits are unchanged.
    """
    plan = par.plan
    extra = (-ids.shape[1]) % plan.tp if plan.sequence_parallel and plan.tp > 1 else 0
    if not extra:
        return ids, mask
    pad = torch.zeros(ids.shape[0], extra, dtype=ids.dtype, device=ids.device)
    return torch.cat([pad, ids], 1), torch.cat([torch.zeros_like(pad, dtype=mask.dtype), mask], 1)


def _decode(tok, new_ids: torch.Tensor) -> list[str]:
    out = []
    for row in new_ids.tolist():
        if tok.eos_token_id in row:
            row = row[:row.index(tok.eos_token_id)]
        out.append(tok.decode(row, skip_special_tokens=True))
    return out
