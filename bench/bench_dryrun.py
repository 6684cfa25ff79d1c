"""Wall time and peak memory of a dry run: Llama-3-70B on 1,024 virtual ranks (dp 16 x pp 8 x tp 8),
and a mixture of experts, Qwen3-235B-A22B on 256 (pp 2 x fsdp 128, experts over ep 16; routing
assumed uniform).

Each case runs in a fresh Python process (so its peak resident memory is the dry run's,
torch and transformers imports included) and prints one table row: the plan, virtual
ranks, simulated ranks, seconds for the dry run itself (torch's import included: it loads
on the first call) and for the whole process, the process's peak RSS, and the busiest
rank's bytes (params + grads + optimizer + activations, as the dry run records them).
The goal: <= 60 s and <= 2 GB on a 2-core machine (the MoE row: <= 120 s, <= 2 GB).
Run: .venv/bin/python bench/bench_dryrun.py [--quick | --first | --moe]
(--quick: Llama-3-8B on 64 ranks only; --moe: the Qwen3-235B row only; --paper: Llama-3.1-405B
on the 1,024 ranks of its paper's 16 uneven stages)
Knows nothing of pytest or of a Session.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CASES = [
    ("llama-3-70b", "dp=16 pp=8 tp=8 batch_size=128 seq_len=4096 precision=bf16"),
    ("llama-3-70b", "fsdp=16 pp=8 tp=8 batch_size=128 seq_len=4096 precision=bf16"),
    # The Llama 3 paper's layout: 126 layers on 16 stages (7, 8 x 14, 7: the first and last also embed / hold the head)
    ("llama-3.1-405b", "fsdp=8 pp=16 tp=8 batch_size=128 seq_len=8192 precision=bf16"),
    ("qwen3-235b-a22b", "pp=2 fsdp=128 ep=16 batch_size=256 seq_len=4096 precision=bf16 recompute=full"),
]
MOE = [c for c in CASES if c[0] == "qwen3-235b-a22b"]
QUICK = [("llama-3-8b", "dp=4 pp=4 tp=4 batch_size=16 seq_len=2048 precision=bf16")]

CHILD = r"""
import json, resource, sys, time
from interactive_parallel import Plan, dry_run
model, text = sys.argv[1], sys.argv[2]
t = time.perf_counter()
d = dry_run(model, Plan.parse(text))
run_s = time.perf_counter() - t
busiest = max(d.memory(), key=lambda m: m.params + m.grads + m.optimizer + m.activations)
print(json.dumps({"world": d.world, "simulated": len(d.simulated), "run_s": run_s,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rank": busiest.rank, "params": busiest.params, "grads": busiest.grads,
                  "optimizer": busiest.optimizer, "activations": busiest.activations}))
"""


def run_case(model: str, plan: str) -> dict:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model, plan], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{model} {plan}: exit {out.returncode}\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - t  # interpreter start and imports included
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Llama-3-8B on 64 ranks only")
    parser.add_argument("--first", action="store_true", help="only the 70B on 1,024 ranks (the goal)")
    parser.add_argument("--moe", action="store_true", help="only Qwen3-235B-A22B on 256 ranks")
    parser.add_argument("--paper", action="store_true", help="only Llama-3.1-405B on 16 uneven stages")
    args = parser.parse_args()
    paper = [c for c in CASES if c[0] == "llama-3.1-405b"]
    cases = QUICK if args.quick else CASES[:1] if args.first else MOE if args.moe else paper if args.paper else CASES
    print(f"{'model':15} {'plan':75} {'ranks':>6} {'simulated':>9} {'dry run s':>9} {'process s':>9} {'peak RSS':>9} "
          f"{'busiest rank: params / grads / optimizer / activations (GiB)':>60}")
    gib = 2 ** 30
    for model, plan in cases:
        r = run_case(model, plan)
        per_rank = (f"rank {r['rank']}: {r['params'] / gib:.2f} / {r['grads'] / gib:.2f} / {r['optimizer'] / gib:.2f} / "
                    f"{r['activations'] / gib:.2f} = {sum(r[k] for k in ('params', 'grads', 'optimizer', 'activations')) / gib:.2f}")
        print(f"{model:15} {plan:75} {r['world']:6d} {r['simulated']:9d} {r['run_s']:9.1f} {r['process_s']:9.1f} "
              f"{r['peak_rss'] / gib:7.2f} GiB {per_rank:>60}", flush=True)


if __name__ == "__main__":
    main()
