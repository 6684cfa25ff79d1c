"""Decoding speed: KV-cached generation against the recompute loop it replaced and against
transformers' own `model.generate`, and quantization's bytes and speed.

Prints three tables:
1. one rank, tiny-llama, 4 prompts x 128 new tokens (greedy): tokens/s of the recompute loop
   (every step runs the whole prefix again; the loop runtime/inference/generate.py had before the KV
   cache, kept here as the baseline), of runtime.inference.generate (KV-cached) and of transformers'
   `model.generate` on the same weights, with the ratios the README quotes (>= 5x the
   recompute loop, within 1.2x of model.generate);
2. the same on spawned gloo ranks under dp, tp and pp (recompute vs cached);
3. quantization (runtime.inference.quantize) on one rank: parameter bytes and greedy tokens/s before
   and after, and the share of greedy tokens unchanged.
Run: .venv/bin/python bench/bench_generate.py [--tokens 128 200] [--ranks 4] [--model tiny-llama]
Knows nothing of pytest; spawned ranks come from tests/mp_harness.py.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
PROMPTS = ["12+35=", "7+8=", "99+1=", "1+2+3+4+5="]


def recompute_generate(par, prompts: list[str], max_new_tokens: int, on_step=None) -> list[str]:
    """The decoding loop before the KV cache, as runtime/inference/generate.py had it (greedy part): the
    whole padded prefix through the model at every step (Parallelized.forward_logits), and with
    `on_step` (as a Session call passes it) each row's text decoded again to find the new piece."""
    import torch

    from interactive_parallel.runtime.inference.generate import decode_new, encode
    from interactive_parallel.runtime.model.tokenizer import get_tokenizer

    tok = get_tokenizer()
    ids, mask = encode(prompts, par.device)
    start = ids.shape[1]
    shown = [""] * len(prompts)
    sp = par.plan.tp if par.plan.sequence_parallel and par.plan.tp > 1 else 1
    with torch.no_grad():
        for position in range(max_new_tokens):
            extra = (-ids.shape[1]) % sp
            step_ids = torch.cat([torch.zeros(ids.shape[0], extra, dtype=ids.dtype), ids], 1)
            step_mask = torch.cat([torch.zeros(ids.shape[0], extra, dtype=mask.dtype), mask], 1)
            pos = (step_mask.cumsum(-1) - 1).clamp(min=0)
            logits = par.forward_logits(step_ids, attention_mask=step_mask, position_ids=pos)[:, -1].float()
            logits[:, len(tok):] = float("-inf")
            nxt = logits.argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
            if on_step is not None:
                texts = decode_new(ids[:, start:])
                done = [tok.eos_token_id in row or position == max_new_tokens - 1 for row in ids[:, start:].tolist()]
                pieces = [t[len(p):] for t, p in zip(texts, shown)]
                shown = texts
                if on_step(position, pieces, done):
                    break
    return decode_new(ids[:, start:])


def _timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def one_rank(model: str, tokens: int, repeats: int) -> None:
    import torch

    from interactive_parallel.plan import PRESETS, Plan
    from interactive_parallel.runtime.inference.generate import encode, generate
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.model.tokenizer import get_tokenizer

    torch.set_num_threads(1)
    par = parallelize(PRESETS[model], Plan())
    par.raw.eval()
    tok = get_tokenizer()
    ids, mask = encode(PROMPTS, "cpu")
    n = len(PROMPTS) * tokens

    def hf():
        with torch.no_grad():
            return par.raw.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                    do_sample=False, suppress_tokens=list(range(len(tok), par.spec.vocab_size)),
                                    pad_token_id=tok.pad_token_id)

    generate(par, PROMPTS, 4)  # warm
    quiet = lambda *a: False  # noqa: E731 - what a Session call's callback costs, minus the channel
    hf_s, _ = _timed(hf, repeats)
    rows = {}
    for label, callback in (("", None), (", streaming", quiet)):
        kw = {} if callback is None else dict(on_step=callback)
        cached_s, cached = _timed(lambda: generate(par, PROMPTS, tokens, **kw), repeats)
        recompute_s, recomputed = _timed(lambda: recompute_generate(par, PROMPTS, tokens, **kw), repeats)
        rows[label] = (recompute_s, cached_s, cached == recomputed)
    print(f"\n1. one rank, {model}, {len(PROMPTS)} prompts x {tokens} new tokens (median of {repeats}; streaming: "
          f"with the per-step callback a Session call passes)")
    print(f"{'loop':<46}{'tokens/s':>10}{'seconds':>10}")
    for label, (recompute_s, cached_s, _) in rows.items():
        print(f"{'recompute (before the KV cache)' + label:<46}{n / recompute_s:>10.0f}{recompute_s:>10.3f}")
        print(f"{'runtime.inference.generate (KV-cached)' + label:<46}{n / cached_s:>10.0f}{cached_s:>10.3f}")
    print(f"{'transformers model.generate':<46}{n / hf_s:>10.0f}{hf_s:>10.3f}")
    for label, (recompute_s, cached_s, same) in rows.items():
        print(f"cached / recompute{label}: {recompute_s / cached_s:.1f}x (goal: >= 5x); same text: {same}")
    print(f"model.generate time / cached time: {rows[''][1] / hf_s:.2f} (goal: <= 1.2)")


def _ranks_worker(rank: int, model: str, plans: list[dict], tokens: int) -> dict:
    import torch.distributed as dist

    from interactive_parallel.plan import PRESETS, Plan
    from interactive_parallel.runtime.inference.generate import generate
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.rank import state

    out = {}
    for fields in plans:
        plan = Plan(**fields)
        par = parallelize(PRESETS[model], plan)
        generate(par, PROMPTS, 2)
        dist.barrier()
        t = time.perf_counter()
        cached = generate(par, PROMPTS, tokens)
        cached_s = time.perf_counter() - t
        dist.barrier()
        t = time.perf_counter()
        recomputed = recompute_generate(par, PROMPTS, tokens)
        out[plan.describe()] = (cached_s, time.perf_counter() - t, cached == recomputed)
        state.get().reset_model()
    return out


def many_ranks(model: str, tokens: int, ranks: int) -> None:
    from mp_harness import run_ranks

    plans = [dict(dp=ranks), dict(tp=ranks), dict(pp=ranks), dict(dp=ranks // 2, tp=2)]
    res = run_ranks(_ranks_worker, ranks, model, plans, tokens, timeout_s=1800)[0]
    n = len(PROMPTS) * tokens
    print(f"\n2. {ranks} spawned gloo ranks, {model}, every rank decoding the {len(PROMPTS)} prompts x {tokens} tokens")
    print(f"{'plan':<10}{'recompute tok/s':>17}{'cached tok/s':>14}{'speed-up':>10}{'same text':>11}")
    for label, (cached_s, recompute_s, same) in res.items():
        print(f"{label:<10}{n / recompute_s:>17.0f}{n / cached_s:>14.0f}{recompute_s / cached_s:>9.1f}x{str(same):>11}")


def quantization(models: list[str]) -> None:
    import torch

    from interactive_parallel.plan import PRESETS, Plan
    from interactive_parallel.plan.inference import QUANT_SCHEMES
    from interactive_parallel.runtime.inference.quantize import quantize, restore
    from interactive_parallel.runtime.layout.parallelize import parallelize

    torch.set_num_threads(1)
    print("\n3. quantization on one rank (runtime.inference.quantize; tokens/s of greedy decoding, 4 prompts x 32 tokens)")
    print(f"{'model':<12}{'scheme':<18}{'params before':>14}{'after':>10}{'tok/s before':>14}{'after':>8}"
          f"{'tokens unchanged':>18}")
    for model in models:
        par = parallelize(PRESETS[model], Plan())
        for scheme in QUANT_SCHEMES:
            rec, kept = quantize(par, scheme, 0)
            restore(par, kept)
            print(f"{model:<12}{scheme:<18}{rec.params_before / 2**20:>11.2f} MiB{rec.params_after / 2**20:>6.2f} MiB"
                  f"{rec.tokens_per_s_before:>14.0f}{rec.tokens_per_s_after:>8.0f}{rec.agreement:>18.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for tokens in args.tokens:
        one_rank(args.model, tokens, args.repeats)
    if args.ranks > 1:
        many_ranks(args.model, args.tokens[0], args.ranks)
    quantization([args.model, "small-llama"])


if __name__ == "__main__":
    main()
