"""Expert parallelism on a small Mixtral shape: the Session against plain torchrun on the same
layout, and ep against replicated experts in memory per rank and step time. Prints a table.

    .venv/bin/python bench/bench_moe.py [--steps 10] [--repeats 3]

Plans on 4 ranks: dp4 + ep4 (each rank holds 2 of the 8 experts of every layer, tokens go to
them and back with all-to-alls) and dp4 (every rank holds all 8). Times are medians of
`repeats` calls of train(steps) after a warm-up, ms per step; torchrun runs the same
`train_step` (bench/_torchrun_worker.py). Memory is the probes' bytes per rank.
"""
from __future__ import annotations

import argparse
import sys

from bench_session import torchrun_numbers, train_step_s

from interactive_parallel import Plan, Session

MIXTRAL = dict(model_type="mixtral", vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
               num_experts_per_tok=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
PLANS = {"dp4xep4": dict(dp=4, ep=4), "dp4": dict(dp=4)}
BATCH = dict(batch_size=8, seq_len=64)
MIB = 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ours, mem = {}, {}
    with Session(ranks=4) as s:
        s.load_model(MIXTRAL)
        for name, fields in PLANS.items():
            s.apply(Plan(**fields, **BATCH))
            ours[name] = train_step_s(s, args.steps, args.repeats, snapshot_every=0) * 1e3
            last = max(r.step for r in s.memory())
            mine = [r for r in s.memory() if r.step == last]
            mem[name] = (max(r.params + r.grads + r.optimizer for r in mine) / MIB,
                         max(r.activations for r in mine) / MIB)
            a2a = [c for c in s.comms(1) if c.op == "all_to_all" and c.rank == 0]
            mem[name] += (sum(c.bytes for c in a2a) / MIB,)
    theirs = torchrun_numbers(4, list(PLANS), args.steps, args.repeats, table=PLANS, batch=BATCH, model=MIXTRAL)
    print(f"small Mixtral (8 experts, top 2, {MIXTRAL['num_hidden_layers']} layers x {MIXTRAL['hidden_size']}), "
          f"batch {BATCH['batch_size']} x {BATCH['seq_len']}, 4 ranks, fp32")
    print(f"{'plan':<10} {'Session ms':>10} {'torchrun ms':>11} {'ratio':>6} {'p+g+opt MiB/rank':>17} "
          f"{'act MiB':>8} {'a2a MiB/step r0':>16}")
    for name in PLANS:
        t = theirs[f"step_{name}"]
        state, act, a2a = mem[name]
        print(f"{name:<10} {ours[name]:>10.1f} {t:>11.1f} {ours[name] / t:>6.2f} {state:>17.2f} {act:>8.2f} {a2a:>16.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
