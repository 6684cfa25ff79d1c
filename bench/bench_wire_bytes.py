"""Bytes a training step moves per rank, side by side with torchtitan's on the same model and layout.

The model is torchtitan's llama3 debug model (dim 256, 6 layers, 16 heads, ffn 768, vocabulary
2048, untied) as a transformers Llama config; 4 ranks, global batch 8 x 64, one step. The bytes
are the comm ledger's (each collective's whole buffer, as nccl-tests counts an op's size) on rank
0, read from a dry run: the runtime's own layout and step on fake tensors, whose records equal a
live run's (tests/test_dryrun.py). torchtitan's figures are quoted, not run: torchtitan 0.3.0 on 4
gloo ranks, the same collectives counted (2026-12, the figures the GPU-communication issue gives).
`--clip` adds gradient clipping (max_grad_norm 1.0, torchtitan's default) and prints what it adds.
Run: .venv/bin/python bench/bench_wire_bytes.py [--clip] [--by-op]
Knows nothing of pytest.
"""
from __future__ import annotations

import argparse
import collections

DEBUG_MODEL = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 16,
               "num_key_value_heads": 16, "intermediate_size": 768, "vocab_size": 2048,
               "tie_word_embeddings": False, "max_position_embeddings": 2048}
LAYOUTS = {"fsdp4": dict(fsdp=4),
           "fsdp2 x tp2, sequence + loss parallel": dict(fsdp=2, tp=2, sequence_parallel=True, loss_parallel=True)}
TORCHTITAN_MB = {("fsdp4", "fp32"): 76.1, ("fsdp2 x tp2, sequence + loss parallel", "fp32"): 51.7,
                 ("fsdp4", "bf16"): 50.4, ("fsdp2 x tp2, sequence + loss parallel", "bf16"): 32.0}
"""torchtitan 0.3.0, rank 0, bytes per step in MB (10^6), as quoted above."""


def main() -> None:
    from interactive_parallel import Plan, dry_run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clip", action="store_true", help="also with max_grad_norm=1.0")
    ap.add_argument("--by-op", action="store_true", help="each layout's bytes by (op, axis, dtype)")
    args = ap.parse_args()
    print("| layout | precision | torchtitan | this project | ratio |" + (" with clipping |" if args.clip else ""))
    print("|---|---|---:|---:|---:|" + ("---:|" if args.clip else ""))
    for label, fields in LAYOUTS.items():
        for precision in ("fp32", "bf16"):
            plan = Plan(**fields, precision=precision, batch_size=8, seq_len=64)
            comms = dry_run(DEBUG_MODEL, plan).comms(0)
            ours = sum(c.bytes for c in comms) / 1e6
            anchor = TORCHTITAN_MB[(label, precision)]
            row = f"| {label} | {precision} | {anchor:.1f} MB | {ours:.1f} MB | {ours / anchor:.2f}x |"
            if args.clip:
                clipped = dry_run(DEBUG_MODEL, plan.replace(max_grad_norm=1.0)).comms(0)
                extra = [c for c in clipped if c.module == "clip_grad_norm"]
                row += f" +{sum(c.bytes for c in extra)} B in {len(extra)} all-reduces |"
            print(row)
            if args.by_op:
                by = collections.Counter()
                for c in comms:
                    by[(c.op, c.axis, c.dtype)] += c.bytes
                for (op, axis, dtype), n in sorted(by.items(), key=lambda kv: -kv[1]):
                    print(f"|   {op} on {axis} | {dtype} | | {n / 1e6:.2f} MB | |" + (" |" if args.clip else ""))


if __name__ == "__main__":
    main()
