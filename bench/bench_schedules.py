"""Pipeline schedules measured: each rank's idle share of a step under 1F1B and the interleaved and
zero-bubble schedules, on the same plan, beside the idle torch's simulator predicts.

Starts a Session of --pp ranks, loads the model (a preset, --layers decoder layers), and for each
schedule applies Plan(pp, that schedule, --microbatches) and trains --warmup steps then --steps
steps with the probes on; per rank the idle share of each measured step is viz.bubble_fractions
of its PipelineEvents (1 - the union of its compute intervals / the step's span), and the table
gives the median over the steps and, beside it, Session.preview_schedule's simulated idle (every
action, sends and receives too, one slot). docs/measured.md's pipeline table quotes it; notebook 03
asserts the zero-bubble row below 1F1B's on its own, smaller plan.
Run: .venv/bin/python bench/bench_schedules.py [--model small-llama] [--layers 8] [--microbatches 8]
     [--batch 16] [--seq 128] [--steps 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

SCHEDULES = ("1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")


def measure(session, plan, warmup: int, steps: int) -> dict[int, float]:
    """Per rank the median idle share over `steps` measured steps (after `warmup`)."""
    from interactive_parallel.viz import bubble_fractions

    session.apply(plan)
    session.train(steps=warmup)
    session.train(steps=steps)
    events = session.timeline(steps)
    per_step = [bubble_fractions(events, step=s) for s in sorted({e.step for e in events if hasattr(e, "stage")})]
    ranks = sorted(per_step[-1])
    return {r: statistics.median(f[r] for f in per_step if r in f) for r in ranks}


def main() -> None:
    from interactive_parallel import Plan, Session
    from interactive_parallel.plan import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    args = ap.parse_args()
    base = PRESETS[args.model]
    spec = dataclasses.replace(base, name=f"{args.model}-{args.layers}l",
                               config={**base.config, "num_hidden_layers": args.layers})
    rows = []
    with Session(ranks=args.pp) as s:
        s.load_model(spec)
        for name in args.schedules.split(","):
            plan = Plan(pp=args.pp, pp_schedule=name, microbatches=args.microbatches, batch_size=args.batch,
                        seq_len=args.seq)
            simulated = s.preview_schedule(plan).idle
            measured = measure(s, plan, args.warmup, args.steps)
            rows.append((name, measured, simulated))
    print(f"{spec.name}, pp {args.pp}, {args.microbatches} microbatches of {args.batch // args.microbatches}x{args.seq}, "
          f"fp32, CPU gloo; median over {args.steps} steps")
    ranks = sorted(rows[0][1])
    print("| schedule | " + " | ".join(f"rank {r} idle measured (simulated)" for r in ranks) + " | mean measured |")
    print("|---|" + "---|" * (len(ranks) + 1))
    for name, measured, simulated in rows:
        cells = [f"{measured[r]:.0%} ({simulated[r]:.0%})" for r in ranks]
        print(f"| {name} | " + " | ".join(cells) + f" | {statistics.mean(measured.values()):.0%} |")


if __name__ == "__main__":
    main()
