"""Context parallel's K/V memory per rank: ring against all-gather, measured beside the prediction.

Runs one fp32 training step of tiny-llama at a long sequence (--seq 1024) on spawned gloo ranks
under cp (--cp 4), once with `cp_method="allgather"` and once with "ring", and prints per plan
rank 0's measured activation peak (the memory probe) beside the prediction (plan.estimate), the
attention's part of the prediction (plan.activations.layer_parts, every layer: under all-gather
the whole sequence's K and V and the causal mask, under ring only the local K/V block), and the
ring's sends per step (the comm ledger). The last line compares the measured saving (all-gather's
peak minus ring's) with the predicted one. docs/measured.md's context-parallel table quotes it.
Run: .venv/bin/python bench/bench_cp.py [--cp 4] [--batch 2] [--seq 1024]
Knows nothing of pytest; spawned ranks come from tests/mp_harness.py.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

MIB = 2 ** 20


def main() -> None:
    from mp_harness import run_ranks
    import parity_workers as W

    from interactive_parallel.plan import PRESETS, Plan
    from interactive_parallel.plan.activations import layer_parts
    from interactive_parallel.plan.estimate import predict_memory

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()
    spec = PRESETS["tiny-llama"]
    configs = [(method, spec, dict(cp=args.cp, cp_method=method, batch_size=args.batch, seq_len=args.seq))
               for method in ("allgather", "ring")]
    ranks = run_ranks(W.one_step_records, args.cp, configs, "fp32", timeout_s=900)
    print(f"{spec.name}, batch {args.batch}x{args.seq}, cp {args.cp}, fp32, rank 0")
    print("| cp_method | activations measured | predicted | ratio | attention's part (predicted) | p2p sends |")
    print("|---|---|---|---|---|---|")
    measured, predicted = {}, {}
    for label, _, fields in configs:
        plan = Plan(**fields)
        memory, comms, _ = ranks[0][label]
        measured[label], predicted[label] = memory.activations, predict_memory(spec, plan)[0].activations
        attention = layer_parts(spec, plan, args.batch).attention * spec.num_layers
        sends = [c for c in comms if c.op == "send"]
        print(f"| {label} | {measured[label] / MIB:.2f} MiB | {predicted[label] / MIB:.2f} MiB | "
              f"{predicted[label] / measured[label]:.3f} | {attention / MIB:.2f} MiB | "
              f"{len(sends)} ({sum(c.bytes for c in sends) / MIB:.2f} MiB) |")
    saved_m = measured["allgather"] - measured["ring"]
    saved_p = predicted["allgather"] - predicted["ring"]
    print(f"ring saves {saved_m / MIB:.2f} MiB per rank measured, {saved_p / MIB:.2f} MiB predicted "
          f"(ratio {saved_p / saved_m:.3f})")


if __name__ == "__main__":
    main()
