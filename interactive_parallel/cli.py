"""Command line: the headless demo (writes an HTML report) and the environment check.

Owns argument parsing and printing; every action goes through the same Session a
notebook uses. Knows nothing of engines or torch.
"""
from __future__ import annotations

import argparse
import random
import re
import sys
import time

from .plan import PRESETS, Plan, PlanError, UnknownModelError, check


def _demo(args: argparse.Namespace) -> int:
    from .cluster import Session
    from .cluster.offline import resolved, usable_cores

    if args.ranks is None:  # one rank per core: more ranks than cores time-slice and each step waits
        args.ranks = max(2, min(4, usable_cores()))
    plan = Plan.parse(args.plan or f"dp={args.ranks}", batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr)

    check(plan, args.ranks, resolved(args.model))  # before any process starts
    prompts = args.prompt or _additions(args.quiz)
    t0 = time.perf_counter()
    with Session(ranks=args.ranks, device=plan.device) as s:
        print(f"{s.world_size} ranks ready in {time.perf_counter() - t0:.1f} s")
        s.load_model(args.model)
        s.apply(plan)
        before = s.generate(prompts, max_new_tokens=args.max_new_tokens)
        print(f"model {args.model} laid out as {plan.describe()}; training {args.steps} steps")

        def progress(records):
            losses = [r.loss for r in records if r.loss == r.loss]
            if records and losses and (records[0].step % max(1, args.steps // 10) == 0
                                       or records[0].step == args.steps - 1):
                print(f"  step {records[0].step:4d}  loss {sum(losses) / len(losses):.3f}")

        t1 = time.perf_counter()
        s.train(steps=args.steps, on_step=progress)
        print(f"trained in {time.perf_counter() - t1:.0f} s")
        after = s.generate(prompts, max_new_tokens=args.max_new_tokens)
        _quiz_table(prompts, before, after, args.steps)
        path = s.report(args.report, title=f"interactive_parallel demo: {args.model}, {plan.describe()}")
    print(f"report written to {path}: open it in a browser (loss, memory, communication and layout per rank)")
    print("next: ./dev.sh start opens the tour notebook (notebooks/00_tour.ipynb); "
          "docs/index.md lists a page per topic")
    return 0


def _additions(n: int) -> list[str]:
    """`n` prompts drawn as the training task draws its problems (runtime/data.py: two numbers
    below 100), from a seed of their own: a fair sample of what the model was taught, not a
    hand-picked one."""
    rng = random.Random(2024)
    return [f"{rng.randrange(100)}+{rng.randrange(100)}=" for _ in range(n)]


def _quiz_table(prompts: list[str], before: list[str], after: list[str], steps: int) -> None:
    """Each prompt with the right sum (for an 'a+b=' prompt) beside the model's answers before and
    after training, and how many it got right: the reader judges what was learned."""
    def answer(text: str) -> str:  # the completion up to the end of its line
        return text.split("\n", 1)[0]

    sums = [str(int(m[1]) + int(m[2])) if (m := re.fullmatch(r"(\d+)\+(\d+)=", p)) else "" for p in prompts]
    width = max(len(p) for p in prompts) + 2
    print(f"  {'prompt':<{width}}{'sum':<6}{'before training':<18}after {steps} steps")
    for p, want, b, a in zip(prompts, sums, before, after):
        mark = ("right" if answer(a) == want else "wrong") if want else ""
        print(f"  {p:<{width}}{want:<6}{answer(b)!r:<18}{answer(a)!r:<8}{mark}")
    if any(sums):
        asked = sum(1 for w in sums if w)
        right = [sum(answer(x) == w for x, w in zip(out, sums) if w) for out in (before, after)]
        print(f"right: {right[1]} of {asked} after {steps} steps (before training: {right[0]} of {asked})")


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
    demo.add_argument("--ranks", type=int, default=None, help="default: one per usable core, 2 to 4")
    demo.add_argument("--plan", default=None,
                      help="degrees and knobs, e.g. 'dp=2,tp=2' or 'dp=4 precision=bf16' (default: dp over every rank)")
    demo.add_argument("--model", default="tiny-llama", help=f"a preset ({', '.join(PRESETS)}) or a local directory")
    # 800 steps of 16 x 128 tokens at lr 2e-3: where tiny-llama has learned most two-digit sums (7
    # or 8 of the 8 asked; at 30 steps of 8 x 64 it answered '1=1='). README's Quickstart has its time.
    demo.add_argument("--steps", type=int, default=800)
    demo.add_argument("--batch-size", type=int, default=16)
    demo.add_argument("--seq-len", type=int, default=128)
    demo.add_argument("--lr", type=float, default=2e-3)
    demo.add_argument("--prompt", action="append",
                      help="a prompt to complete before and after training (repeatable; default: --quiz additions)")
    demo.add_argument("--quiz", type=int, default=8, help="how many random additions to ask when no --prompt is given")
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
