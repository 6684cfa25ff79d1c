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


def session_numbers(ranks: int, steps: int, warm: bool) -> dict:
    t0 = time.perf_counter()
    pool = LocalPool(ranks, warm_imports=warm)
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
    args = ap.parse_args()
    warm = session_numbers(args.ranks, args.steps, warm=True)
    cold = session_numbers(args.ranks, args.steps, warm=False)
    tr = torchrun_numbers(args.ranks, args.steps)
    rows = [
        ("ranks ready (pool + process group), s", warm["ready"], cold["ready"], tr["ready"]),
        ("ranks ready + model laid out, s", warm["model"], cold["model"], tr["model"]),
        ("no-op call to all ranks, median ms", warm["noop_ms"], cold["noop_ms"], None),
        ("same, bare ipyparallel apply_sync, ms", warm["ipp_noop_ms"], cold["ipp_noop_ms"], None),
        ("train step dp, median ms (client view)", warm["step_ms"], cold["step_ms"], tr["step_ms"]),
    ]
    print(f"tiny-llama, dp={args.ranks}, batch 8x64, {os.cpu_count()} cores")
    print(f"{'':44s} {'session':>10s} {'no warm-up':>10s} {'torchrun':>10s}")
    for name, a, b, c in rows:
        fmt = lambda v: f"{v:10.2f}" if v is not None else f"{'-':>10s}"  # noqa: E731
        print(f"{name:44s} {fmt(a)} {fmt(b)} {fmt(c)}")
    print(f"step ratio session/torchrun: {warm['step_ms'] / tr['step_ms']:.2f}")


if __name__ == "__main__":
    main()
