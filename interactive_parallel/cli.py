"""Command line: the headless demo (writes an HTML report) and the environment check.

Owns argument parsing and printing; every action goes through the same Session a
notebook uses. Knows nothing of engines or torch.
"""
from __future__ import annotations

import argparse
import sys
import time

from .plan import PRESETS, Plan, PlanError, UnknownModelError, check


def _demo(args: argparse.Namespace) -> int:
    from .cluster import Session
    from .cluster.offline import resolved

    plan = Plan.parse(args.plan, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr)

    check(plan, args.ranks, resolved(args.model))  # before any process starts
    t0 = time.perf_counter()
    with Session(ranks=args.ranks, device=plan.device) as s:
        print(f"{s.world_size} ranks ready in {time.perf_counter() - t0:.1f} s")
        s.load_model(args.model)
        s.apply(plan)
        print(f"model {args.model} laid out as {plan.describe()}; training {args.steps} steps")

        def progress(records):
            losses = [r.loss for r in records if r.loss == r.loss]
            if records and records[0].step % max(1, args.steps // 10) == 0 and losses:
                print(f"  step {records[0].step:4d}  loss {sum(losses) / len(losses):.3f}")

        s.train(steps=args.steps, on_step=progress)
        prompts = args.prompt or ["12+35=", "7+8=", "40+2="]
        for p, out in zip(prompts, s.generate(prompts, max_new_tokens=args.max_new_tokens)):
            print(f"  {p!r} -> {out!r}")
        path = s.report(args.report, title=f"interactive_parallel demo: {args.model}, {plan.describe()}")
    print(f"report written to {path}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .cluster import Session

    with Session(ranks=args.ranks, device=args.device) as s:
        rows = s.doctor()
        print(rows)
    return 0 if all(r.all_reduce_ok for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="interactive-parallel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train and generate on local ranks, write an HTML report")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--plan", default="dp=4", help="degrees and knobs, e.g. 'dp=2,tp=2' or 'dp=4 precision=bf16'")
    demo.add_argument("--model", default="tiny-llama", help=f"a preset ({', '.join(PRESETS)}) or a local directory")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--batch-size", type=int, default=8)
    demo.add_argument("--seq-len", type=int, default=64)
    demo.add_argument("--lr", type=float, default=3e-3)
    demo.add_argument("--prompt", action="append", help="a prompt to complete after training (repeatable)")
    demo.add_argument("--max-new-tokens", type=int, default=4)
    demo.add_argument("--report", default="report.html")
    doctor = sub.add_parser("doctor", help="check the distributed environment on local ranks")
    doctor.add_argument("--ranks", type=int, default=2)
    doctor.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    try:
        return {"demo": _demo, "doctor": _doctor}[args.command](args)
    except (PlanError, UnknownModelError) as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
