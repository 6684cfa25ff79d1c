"""Cost of the per-step probes, of tracing the collectives' causes and of the collective debug
mode, on spawned gloo ranks.

Prints a table: median step time of tiny-llama with probes on vs off, and with the probes on,
tracing (runtime/probes/causes.py) off vs on (steps interleaved on/off so load drift hits both
alike), with TORCH_DISTRIBUTED_DEBUG=DETAIL vs OFF for a tiny all_reduce and a step, and with
torch's flight recorder off vs on (runtime/probes/recorder.py; the session's default size).
Run: .venv/bin/python bench/bench_probes.py [--ranks 4] [--only probes|recorder]
Knows nothing of pytest; uses tests/mp_harness.py to start the ranks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
PLANS = [dict(dp=4), dict(fsdp=4), dict(dp=2, tp=2), dict(dp=2, pp=2)]
TRACED = PLANS + [dict(dp=2, tp=2, sequence_parallel=True, loss_parallel=True)]


def _steps(rank: int, fields: dict, n: int, toggle: bool, switch: str = "probes") -> dict:
    import torch.distributed as dist

    from interactive_parallel.plan import PRESETS, Plan
    from interactive_parallel.runtime import probes
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.training.train import make_optimizer, train_step

    par = parallelize(PRESETS["tiny-llama"], Plan(batch_size=8, seq_len=64, **fields))
    opt = make_optimizer(par)
    for s in range(3):
        train_step(par, opt, s, rank=rank)
    times: dict[str, list[float]] = {"on": [], "off": []}
    flip = probes.set_enabled if switch == "probes" else probes.set_tracing  # tracing: with the probes on
    for s in range(3, 3 + n):
        on = s % 2 == 0 if toggle else True
        flip(on)
        dist.barrier()
        t = time.perf_counter()
        train_step(par, opt, s, rank=rank)
        times["on" if on else "off"].append(time.perf_counter() - t)
    flip(True)
    return {k: statistics.median(v) for k, v in times.items() if v}


def _all_reduce(rank: int, n: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(16)
    for _ in range(5):
        dist.all_reduce(t)
    out = []
    for _ in range(n):
        s = time.perf_counter()
        dist.all_reduce(t)
        out.append(time.perf_counter() - s)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", choices=("probes", "recorder"), help="only the probes' rows, or the recorder's")
    args = ap.parse_args()
    rows = [] if args.only == "recorder" else _probe_rows(args)
    if args.only != "probes":
        rows += _recorder_rows(args)
    print(f"{'case':52s} {'a (ms)':>9s} {'b (ms)':>9s} {'b/a':>6s}")
    for name, a, b in rows:
        print(f"{name:52s} {a * 1e3:9.2f} {b * 1e3:9.2f} {b / a:6.2f}")


def _probe_rows(args) -> list:
    from mp_harness import run_ranks

    rows = []
    for fields in PLANS:
        t = max(run_ranks(_steps, args.ranks, fields, args.steps, True), key=lambda d: d["on"])
        label = ",".join(f"{k}={v}" for k, v in fields.items())
        rows.append((f"step {label}: probes off / on", t["off"], t["on"]))
    for fields in TRACED:
        t = max(run_ranks(_steps, args.ranks, fields, args.steps, True, "tracing"), key=lambda d: d["on"])
        label = ",".join(f"{k}={v}" for k, v in fields.items()).replace("sequence_parallel=True", "sp") \
            .replace("loss_parallel=True", "lp")
        rows.append((f"step {label}: tracing off / on", t["off"], t["on"]))
    for debug in ("OFF", "DETAIL"):
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug
        ar = max(run_ranks(_all_reduce, args.ranks, 200))
        st = max(run_ranks(_steps, args.ranks, dict(fsdp=4), 10, False), key=lambda d: d["on"])["on"]
        rows.append((f"debug {debug}: all_reduce(16 floats) / fsdp=4 step", ar, st))
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    return rows


def _recorder_rows(args) -> list:
    """Off and on alternated twice (the faster of each kept: load drift hits both alike); the size is
    read by torch when each rank's group is made."""
    from mp_harness import run_ranks

    from interactive_parallel.records.stacks import RECORDER_ENTRIES

    rows, sizes = [], ("0", str(RECORDER_ENTRIES))
    for fields in (None, dict(dp=4), dict(fsdp=4), dict(dp=2, tp=2)):
        got: dict[str, list[float]] = {e: [] for e in sizes}
        for entries in sizes * 2:
            os.environ["TORCH_FR_BUFFER_SIZE"] = entries
            got[entries].append(max(run_ranks(_all_reduce, args.ranks, 200)) if fields is None else
                                max(run_ranks(_steps, args.ranks, fields, 10, False), key=lambda d: d["on"])["on"])
        label = "all_reduce(16 floats)" if fields is None else "step " + ",".join(f"{k}={v}" for k, v in fields.items())
        rows.append((f"{label}: flight recorder off / on", min(got["0"]), min(got[sizes[1]])))
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    return rows


if __name__ == "__main__":
    main()
