"""Predicted against measured step time: the calibrated step-time model on every parity plan.

Starts a Session of 4 ranks; per model, trains the anchor plan (dp4: its measured steps give the
profile the runtime loop's per-step cost) and calibrates the ranks (Session.calibrate, at the
model's shapes), then for each plan applies it, trains --warmup steps, then --steps steps with the
probes off, and takes the measured step time (per step the slowest rank's time_s, the median
over the steps) beside Session.predict_step on the calibrated profile and on the shipped 'cpu'
one. Prints one table per model (dp4's gap is near 0 by construction: it is the anchor), the
typical gap (the median |gap| over the other plans) and the largest; --json writes the rows. The README's
"Which plan?" table quotes it; tests/test_steptime_live.py asserts the typical plan within 25 % and
every plan within a factor of 2.5 on the same plans.
Run: .venv/bin/python bench/bench_steptime.py [--models tiny-llama small-llama] [--steps 6] [--json out.json]
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
    session.apply(plan)
    session.train(steps=warmup, snapshot_every=0)
    records = session.train(steps=steps, snapshot_every=0)
    per_step: dict[int, float] = {}
    for r in records:
        per_step[r.step] = max(per_step.get(r.step, 0.0), r.time_s)
    return statistics.median(per_step.values())


def main() -> None:
    from interactive_parallel import Plan, Session

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-llama", "small-llama"])
    ap.add_argument("--plans", nargs="+", default=list(PLANS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = []
    with Session(ranks=4) as s:
        s.set_probes(False)
        for model in args.models:
            s.load_model(model)
            measured_step(s, Plan(**ANCHOR, **BATCH), args.warmup, args.steps)
            profile = s.calibrate()
            print(f"\n{model}: calibrated fp32 {profile.flops['fp32'] / 1e9:.1f} GFLOP/s, op {profile.op_overhead_s * 1e6:.1f} us, "
                  f"memory {profile.memory_bandwidth / 1e9:.1f} GB/s, overlap {profile.overlap:.2f}, "
                  f"per-step cost {profile.step_overhead_s * 1e3:.1f} ms")
            print(f"{'plan':12s} {'measured ms':>12s} {'predicted':>10s} {'gap':>6s} {'compute':>8s} {'comm':>7s} "
                  f"{'bubble':>7s} {'shipped cpu':>12s}")
            for name in args.plans:
                plan = Plan(**PLANS[name], **BATCH)
                t = measured_step(s, plan, args.warmup, args.steps)
                p, shipped = s.predict_step(plan, profile), s.predict_step(plan, "cpu")
                gap = p.seconds / t - 1
                rows.append(dict(model=model, plan=name, measured_s=t, predicted_s=p.seconds, gap=gap,
                                 compute_s=p.compute_s, comm_s=p.comm_s, bubble_s=p.bubble_s, shipped_s=shipped.seconds))
                print(f"{name:12s} {t * 1e3:12.1f} {p.seconds * 1e3:10.1f} {gap:+6.0%} {p.compute_s * 1e3:8.1f} "
                      f"{p.comm_s * 1e3:7.1f} {p.bubble_s * 1e3:7.1f} {shipped.seconds * 1e3:12.1f}", flush=True)
    for model in args.models:
        gaps = [abs(r["gap"]) for r in rows if r["model"] == model and PLANS[r["plan"]] != ANCHOR]
        if gaps:
            print(f"\n{model}: typical gap {statistics.median(gaps):.0%} over {len(gaps)} plans (the anchor left out)")
    worst = max(rows, key=lambda r: abs(r["gap"]))
    print(f"largest gap: {worst['model']} {worst['plan']} {worst['gap']:+.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
