"""Eager against compiled training steps (Plan(compile=True)): step time and compile time.

    python bench/bench_compile.py [--models tiny-llama small-llama] [--plans dp4 dp2xtp2] [--steps 8]

For each model and plan, one torchrun group (bench/_compile_worker.py) trains `steps` steps
eagerly, then lays the model out again with every decoder block compiled and trains as many.
Step time is the median of the steps after the first; compile time is the first compiled
step minus that median, from an empty compile cache (a fresh TORCHINDUCTOR_CACHE_DIR per
run, removed after). Activations are the bytes saved for backward on the last step (the
memory probe): inductor chooses what to save (it recomputes fused pointwise ops), so they
can differ from eager's. Prints a table; docs/measured.md's table is this output.

    python bench/bench_compile.py --decode

The decode step instead, on one process (tiny-llama, 3 prompts x 24 new tokens, greedy):
`generate` eagerly, through the blocks compiled for training (dynamic=False: every new cache
length is a new shape), and through blocks compiled with dynamic shapes; the first call's
time (compiling included) and the median of the next three.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PLANS = {"dp4": dict(dp=4), "dp2xtp2": dict(dp=2, tp=2)}
BATCH = dict(batch_size=8, seq_len=64)


def run(model: str, plan: str, steps: int) -> dict:
    cache = tempfile.mkdtemp(prefix="ip-bench-compile-")
    cfg = dict(model=model, plan=dict(PLANS[plan], **BATCH), steps=steps)
    world = PLANS[plan].get("dp", 1) * PLANS[plan].get("tp", 1)
    # TMPDIR too: torchrun leaves its torchelastic_* log folder in the temporary directory
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TMPDIR=cache, OMP_NUM_THREADS="1")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_compile_worker.py")
    try:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={world}", worker, json.dumps(cfg)],
                              env=env, capture_output=True, text=True, timeout=1800)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{model} {plan}: torchrun exited {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def decode() -> None:
    import torch

    from interactive_parallel.plan import PRESETS, Plan
    from interactive_parallel.runtime.inference.generate import generate
    from interactive_parallel.runtime.layout.parallelize import parallelize

    torch.set_num_threads(1)
    prompts = ["12+35=", "7+8=", "99+1="]
    print(f"tiny-llama, one process, {len(prompts)} prompts x 24 new tokens, compile from an empty cache")
    print(f"{'blocks':28s} {'first call s':>13s} {'later calls ms (median)':>24s}")
    for how in ("eager", "compiled for training", "compiled, dynamic shapes"):
        cache = tempfile.mkdtemp(prefix="ip-bench-compile-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        torch._dynamo.reset()
        par = parallelize(PRESETS["tiny-llama"], Plan())
        for block in par.raw.model.layers if how != "eager" else ():
            block.compile(fullgraph=how == "compiled for training", dynamic=how != "compiled for training")
        times = []
        try:
            for _ in range(4):
                t = time.perf_counter()
                generate(par, prompts, 24)
                times.append(time.perf_counter() - t)
            print(f"{how:28s} {times[0]:13.1f} {statistics.median(times[1:]) * 1e3:24.1f}", flush=True)
        except Exception as exc:  # noqa: BLE001 - the finding is that it fails
            print(f"{how:28s} fails: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}", flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny-llama", "small-llama"])
    ap.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--decode", action="store_true", help="the decode step instead (one process)")
    args = ap.parse_args()
    if args.decode:
        return decode()
    print(f"batch {BATCH['batch_size']}x{BATCH['seq_len']}, fp32, {os.cpu_count()} cores, one thread per rank, "
          f"median of steps 2-{args.steps}, compile from an empty cache")
    print(f"{'model':12s} {'plan':8s} {'eager ms':>9s} {'compiled ms':>12s} {'speed-up':>9s} {'compile s':>10s} "
          f"{'act. eager KiB':>15s} {'act. compiled KiB':>18s}")
    for model in args.models:
        for plan in args.plans:
            r = run(model, plan, args.steps)
            eager = statistics.median(r["eager"]["times"][1:])
            comp = statistics.median(r["compiled"]["times"][1:])
            compile_s = r["compiled"]["times"][0] - comp
            print(f"{model:12s} {plan:8s} {eager * 1e3:9.1f} {comp * 1e3:12.1f} {eager / comp:8.2f}x "
                  f"{compile_s:10.1f} {r['eager']['activations'] / 1024:15.0f} "
                  f"{r['compiled']['activations'] / 1024:18.0f}", flush=True)


if __name__ == "__main__":
    main()
