"""Predicted against measured step time: the calibrated step-time model on every parity plan.

Starts a Session of 4 ranks; per model and round (--rounds), trains the anchor plan (dp4: its
measured steps give the profile the per-step cost of a replicated wrapper's hooks, which DDP and
replicate plans carry), calibrates the ranks (Session.calibrate, at the model's shapes), then for
each plan applies it, trains --warmup steps, then --steps steps with the probes off, and takes
the measured step time (per step the slowest rank's time_s, the median over the steps) beside
Session.predict_step on the calibrated profile and on the shipped 'cpu' one. Prints each round's
table, then per model the median over the rounds of each plan's measured, predicted and gap, the
gap's range over the rounds, the typical gap (the median |gap| over the plans but the anchor,
whose gap is near 0 by construction) and how many plans come within 25 %; --json writes the
rows. Rounds matter on shared cores: one plan's median, and one calibration, move by tens of
percent with the machine's moment. docs/planning.md's "Predicted against measured" table quotes
the summary. How close a prediction comes is this bench's figure, never a test's bound:
tests/test_steptime_live.py checks what holds on any machine (the anchor's prediction is the
median of its own recorded steps; every plan gets a positive split).
Run: .venv/bin/python bench/bench_steptime.py [--models tiny-llama small-llama] [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

PLANS = {"dp4": dict(dp=4), "fsdp4": dict(fsdp=4), "tp4": dict(tp=4), "pp4": dict(pp=4),
         "dp2xtp2": dict(dp=2, tp=2), "fsdp2xtp2": dict(fsdp=2, tp=2), "dp2xfsdp2": dict(dp=2, fsdp=2),
         "pp2xtp2": dict(pp=2, tp=2), "pp2xdp2": dict(pp=2, dp=2), "cp2xdp2": dict(cp=2, dp=2),
         "cp2xtp2": dict(cp=2, tp=2)}
"""The 4-rank parity plans of tests/test_parallel_parity.py's classic layouts."""
BATCH = dict(batch_size=8, seq_len=64)
ANCHOR = PLANS["dp4"]


def measured_step(session, plan, warmup: int, steps: int) -> float:
    """Median over `steps` steps (after `warmup`) of the slowest rank's step time, probes off."""
    from interactive_parallel.viz import step_times

    session.apply(plan)
    session.train(steps=warmup, snapshot_every=0)
    return statistics.median(t for _, t in step_times(session.train(steps=steps, snapshot_every=0)))


def one_round(session, model: str, plans: list[str], warmup: int, steps: int) -> list[dict]:
    """The anchor's steps, a calibration, then each plan's measured and predicted step: one row per plan."""
    from interactive_parallel import Plan

    anchor = measured_step(session, Plan(**ANCHOR, **BATCH), warmup, steps)
    profile = session.calibrate()
    # the anchor plan measured again first in the table: its gap is how far the machine moved
    # between the anchor's steps and the table's, which every other row's gap carries too
    print(f"\n{model}: anchor run {anchor * 1e3:.1f} ms before calibrating; calibrated fp32 {profile.flops['fp32'] / 1e9:.1f} GFLOP/s, op {profile.op_overhead_s * 1e6:.1f} us, "
          f"memory {profile.memory_bandwidth / 1e9:.1f} GB/s, overlap {profile.overlap:.2f}, per-step cost "
          f"{profile.step_overhead_s * 1e3:.1f} ms, replicated wrapper's {profile.replica_overhead_s * 1e3:.1f} ms")
    print(f"{'plan':12s} {'measured ms':>12s} {'predicted':>10s} {'gap':>6s} {'compute':>8s} {'comm':>7s} "
          f"{'bubble':>7s} {'shipped cpu':>12s}")
    rows = []
    for name in plans:
        plan = Plan(**PLANS[name], **BATCH)
        t = measured_step(session, plan, warmup, steps)
        p, shipped = session.predict_step(plan, profile), session.predict_step(plan, "cpu")
        rows.append(dict(model=model, plan=name, measured_s=t, predicted_s=p.seconds, gap=p.seconds / t - 1,
                         compute_s=p.compute_s, comm_s=p.comm_s, bubble_s=p.bubble_s, shipped_s=shipped.seconds))
        print(f"{name:12s} {t * 1e3:12.1f} {p.seconds * 1e3:10.1f} {rows[-1]['gap']:+6.0%} {p.compute_s * 1e3:8.1f} "
              f"{p.comm_s * 1e3:7.1f} {p.bubble_s * 1e3:7.1f} {shipped.seconds * 1e3:12.1f}", flush=True)
    return rows


def summary(rows: list[dict], model: str, plans: list[str]) -> None:
    """Per plan over the rounds: median measured and predicted, the median gap and its range; then
    the typical gap (median over the plans but the anchor of |median gap|) and the plans within 25 %."""
    print(f"\n{model} over {len({r['round'] for r in rows if r['model'] == model})} round(s):")
    print(f"{'plan':12s} {'measured ms':>12s} {'predicted':>10s} {'gap':>6s} {'range':>13s}")
    typical = []
    for name in plans:
        mine = [r for r in rows if r["model"] == model and r["plan"] == name]
        gaps = sorted(r["gap"] for r in mine)
        gap = statistics.median(gaps)
        if PLANS[name] != ANCHOR:
            typical.append(abs(gap))
        print(f"{name + (' (anchor)' if PLANS[name] == ANCHOR else ''):12s} "
              f"{statistics.median(r['measured_s'] for r in mine) * 1e3:12.1f} "
              f"{statistics.median(r['predicted_s'] for r in mine) * 1e3:10.1f} {gap:+6.0%} "
              f"{f'{gaps[0]:+.0%}..{gaps[-1]:+.0%}':>13s}")
    if typical:
        print(f"{model}: typical gap {statistics.median(typical):.0%}, {sum(g <= 0.25 for g in typical)} of "
              f"{len(typical)} plans within 25 % (median gap over the rounds; the anchor left out)")


def main() -> None:
    from interactive_parallel import Session

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-llama", "small-llama"])
    ap.add_argument("--plans", nargs="+", default=list(PLANS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = []
    with Session(ranks=4) as s:
        s.set_probes(False)
        for model in args.models:
            s.load_model(model)
            for r in range(args.rounds):
                rows += [dict(row, round=r) for row in one_round(s, model, args.plans, args.warmup, args.steps)]
    for model in args.models:
        summary(rows, model, args.plans)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
