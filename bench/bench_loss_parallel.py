"""Loss parallel's memory: the head's activation and the vocabulary weights per rank, with and without it.

Runs one fp32 training step of a tiny Llama with a wide vocabulary (the preset's blocks, vocab_size
--vocab) on spawned gloo ranks under tp with the ends whole (vocab_parallel=False), split (tp's
default: the logits gathered for the loss) and split with `loss_parallel`, and prints per rank
the measured activation peak (the memory probe), the prediction (plan.estimate), the head's part
of the prediction (the final norm, the head's input, the fp32 log-probabilities and targets:
plan.activations.once_per_forward) and the parameter bytes (the embedding and head are split on
the vocabulary but with vocab_parallel=False). docs/layouts.md's loss-parallel table quotes it.
Run: .venv/bin/python bench/bench_loss_parallel.py [--vocab 8192] [--tp 2] [--batch 8] [--seq 64]
Knows nothing of pytest; spawned ranks come from tests/mp_harness.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

MIB = 2 ** 20


def main() -> None:
    from mp_harness import run_ranks
    import parity_workers as W

    from interactive_parallel.plan import PRESETS, Plan
    from interactive_parallel.plan.activations import once_per_forward
    from interactive_parallel.plan.estimate import predict_memory

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    base = PRESETS["tiny-llama"]
    spec = dataclasses.replace(base, name=f"tiny-llama-v{args.vocab}", config={**base.config, "vocab_size": args.vocab})
    plans = {f"tp{args.tp} whole-vocab": dict(tp=args.tp, vocab_parallel=False), f"tp{args.tp}": dict(tp=args.tp),
             f"tp{args.tp} loss-parallel": dict(tp=args.tp, loss_parallel=True)}
    configs = [(label, spec, dict(fields, batch_size=args.batch, seq_len=args.seq)) for label, fields in plans.items()]
    ranks = run_ranks(W.one_step_records, args.tp, configs, "fp32", timeout_s=900)
    print(f"{spec.name}, batch {args.batch}x{args.seq}, fp32, rank 0 (every tp rank holds the same)")
    print("| plan | activations measured | predicted | head's part (predicted) | params per rank |")
    print("|---|---|---|---|---|")
    for label, _, fields in configs:
        plan = Plan(**fields)
        memory = ranks[0][label][0]
        predicted = predict_memory(spec, plan)[0]
        head = once_per_forward(spec, plan, args.batch, first=True, last=True).head
        print(f"| {label} | {memory.activations / MIB:.2f} MiB | {predicted.activations / MIB:.2f} MiB | "
              f"{head / MIB:.2f} MiB | {memory.params / MIB:.2f} MiB |")


if __name__ == "__main__":
    main()
