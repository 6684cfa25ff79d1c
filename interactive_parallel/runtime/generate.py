"""Text generation on this rank: greedy or sampled, batched prompts, no KV cache.

Owns the decoding loop. Every rank runs exactly max_new_tokens forward passes (no early
stop) so that ranks whose forward is a collective stay in lockstep; text is cut at the
end-of-sequence token afterwards. Sampling draws from a generator seeded the same on
every rank, so tensor-parallel ranks agree on each token. Knows nothing of layouts.
"""
from __future__ import annotations

import torch

from .parallelize import Parallelized
from .tokenizer import get_tokenizer


@torch.no_grad()
def generate(par: Parallelized, prompts: list[str], max_new_tokens: int, *, do_sample: bool = False,
             temperature: float = 1.0, top_k: int = 0, seed: int = 0) -> list[str]:
    tok = get_tokenizer()
    if not prompts:
        return []
    enc = tok(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    ids, mask = enc["input_ids"].to(par.device), enc["attention_mask"].to(par.device)
    gen = torch.Generator(device=par.device).manual_seed(seed)
    prompt_len = ids.shape[1]
    par.model.eval()
    try:
        for _ in range(max_new_tokens):
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = par.forward_logits(ids, attention_mask=mask, position_ids=position_ids)[:, -1, :].float()
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
    finally:
        par.model.train()
    out = []
    for row in ids[:, prompt_len:].tolist():
        if tok.eos_token_id in row:
            row = row[:row.index(tok.eos_token_id)]
        out.append(tok.decode(row, skip_special_tokens=True))
    return out
