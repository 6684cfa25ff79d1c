"""Threads per rank when ranks outnumber cores: step time of dp training per setting.

    python bench/bench_threads.py [--ranks 4] [--threads 1 2] [--model tiny-llama]
Prints a table of median step times; the default (runtime.groups.dist.threads_for) is the
host's cores shared out, at least one.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from interactive_parallel import Plan, Session


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    print(f"{args.model}, dp={args.ranks}, batch 8x64, {os.cpu_count()} cores")
    print(f"{'threads/rank':>12s} {'step ms (median)':>18s}")
    for threads in args.threads:
        with Session(ranks=args.ranks, threads=threads) as s:
            s.load_model(args.model)
            s.apply(Plan(dp=args.ranks, batch_size=8, seq_len=64))
            s.train(steps=2)
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                s.train(steps=1)
                times.append(time.perf_counter() - t)
        print(f"{threads:12d} {statistics.median(times) * 1e3:18.1f}")


if __name__ == "__main__":
    main()
