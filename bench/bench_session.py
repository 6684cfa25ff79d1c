"""Session cost against ipyparallel and torchrun: cold start, per-call overhead, step time.

Prints a table. Numbers move with machine load: run on an idle machine, several times.
    python bench/bench_session.py [--ranks 4] [--steps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from interactive_parallel import Plan, Session
from interactive_parallel.cluster.pool import LocalPool


def median_ms(fn, n=30) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def session_numbers(ranks: int, steps: int, launch: str) -> dict:
    t0 = time.perf_counter()
    pool = LocalPool(ranks, launch=launch)
    s = Session(ranks=ranks, _pool=pool)
    ready = time.perf_counter() - t0
    s.load_model("tiny-llama")
    s.apply(Plan(dp=ranks, batch_size=8, seq_len=64))
    model = time.perf_counter() - t0
    noop = median_ms(lambda: s.run(int))
    bare = median_ms(lambda: s.view.apply_sync(int))
    s.train(steps=2)
    step_times = []
    for _ in range(steps):
        t = time.perf_counter()
        s.train(steps=1)
        step_times.append(time.perf_counter() - t)
    s.stop()
    return {"ready": ready, "model": model, "noop_ms": noop, "ipp_noop_ms": bare,
            "step_ms": statistics.median(step_times) * 1e3}


def torchrun_numbers(ranks: int, steps: int) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, BENCH_T0=repr(time.time()), OMP_NUM_THREADS="1")
    out = subprocess.run([str(torchrun), "--standalone", f"--nproc_per_node={ranks}",
                          str(Path(__file__).with_name("_torchrun_worker.py")), str(steps + 2)],
                         env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(out.stderr[-2000:])
    r = json.loads(lines[-1])
    return {"ready": r["ready"], "model": r["model"], "step_ms": r["step"] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--launch", nargs="+", default=["fork", "warm", "plain"])
    args = ap.parse_args()
    cols = {mode: session_numbers(args.ranks, args.steps, mode) for mode in args.launch}
    cols["torchrun"] = torchrun_numbers(args.ranks, args.steps)
    rows = [
        ("ranks ready (pool + process group), s", "ready"),
        ("ranks ready + model laid out, s", "model"),
        ("no-op call to all ranks, median ms", "noop_ms"),
        ("same, bare ipyparallel apply_sync, ms", "ipp_noop_ms"),
        ("train step dp, median ms (client view)", "step_ms"),
    ]
    print(f"tiny-llama, dp={args.ranks}, batch 8x64, {os.cpu_count()} cores; session columns = launch mode")
    print(f"{'':40s}" + "".join(f"{name:>10s}" for name in cols))
    for label, key in rows:
        cells = "".join(f"{c[key]:10.2f}" if key in c else f"{'-':>10s}" for c in cols.values())
        print(f"{label:40s}{cells}")
    first = cols[args.launch[0]]
    print(f"step ratio session({args.launch[0]})/torchrun: {first['step_ms'] / cols['torchrun']['step_ms']:.2f}")


if __name__ == "__main__":
    main()
