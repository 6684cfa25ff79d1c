"""Continuous against static batching: 32 requests with staggered arrivals, served on the ranks.

Prints, per plan and engine: tokens/s over the serving window, mean time to first token
(from arrival), mean time per output token, scheduler steps, and whether every request's text
equals its text in the continuous run (greedy: it must). Policies: continuous with
transformers' engine where it runs under the plan, continuous with ours (this package's
scheduler over transformers' caches), and static (a batch forms only when the previous one
is done) with ours. Requests: prompts of the addition task, arriving every --gap seconds,
each wanting 8 to 64 new tokens; at most --max-batch run at once.
Run: .venv/bin/python bench/bench_serve.py [--ranks 4] [--gap 0.05] [--max-batch 8]
Knows nothing of pytest; the one-rank rows run runtime.inference.serve in this process, the others a Session.
"""
from __future__ import annotations

import argparse
import os

PROMPTS = ["12+35=", "7+8=", "40+2=", "21+21=", "9+90=", "33+4=", "1+1=", "50+50="]


def requests(n: int, gap: float):
    from interactive_parallel.records import Request

    return [Request(id=f"r{i:02d}", prompt=PROMPTS[i % len(PROMPTS)], arrival=round(i * gap, 4),
                    max_new_tokens=8 + (i * 37) % 57) for i in range(n)]


def row(label: str, res, reference) -> str:
    same = all(res.texts[k] == reference.texts[k] for k in reference.texts)
    tpot = [r.tpot for r in res.requests if r.tpot == r.tpot]
    return (f"{label:<34}{res.tokens_per_s:>9.0f}{res.mean_ttft * 1e3:>11.1f}{sum(tpot) / len(tpot) * 1e3:>10.1f}"
            f"{res.n_steps:>7}{str(same):>6}")


HEAD = f"{'plan / engine / policy':<34}{'tok/s':>9}{'TTFT ms':>11}{'TPOT ms':>10}{'steps':>7}{'same':>6}"


def one_rank(reqs, max_batch: int) -> None:
    import torch

    from interactive_parallel.plan import PRESETS, Plan
    from interactive_parallel.runtime.inference.serve import serve as serve_on
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.loop import long_call

    torch.set_num_threads(1)
    par = parallelize(PRESETS["tiny-llama"], Plan())
    kw = dict(reason="", max_batch=max_batch, kv_tokens=None, rank=0)

    def serve(*args, **kwargs):
        with long_call() as boundary:  # each call its own, as runtime.loop.serve gives it
            return serve_on(*args, boundary=boundary, **kwargs)
    serve(par, reqs[:4], engine="ours", policy="continuous", **kw)  # warm
    cont = serve(par, reqs, engine="ours", policy="continuous", **kw)
    print("\none rank, tiny-llama (runtime.inference.serve in this process)")
    print(HEAD)
    print(row("single / transformers / continuous", serve(par, reqs, engine="transformers", policy="continuous", **kw),
              cont))
    print(row("single / ours / continuous", cont, cont))
    print(row("single / ours / static", serve(par, reqs, engine="ours", policy="static", **kw), cont))


def session(reqs, ranks: int, max_batch: int) -> None:
    from interactive_parallel import Plan, Session

    with Session(ranks=ranks) as s:
        s.load_model("tiny-llama")
        print(f"\n{ranks} ranks through a Session, tiny-llama")
        print(HEAD)
        for plan in (Plan(dp=ranks), Plan(dp=ranks // 2, tp=2), Plan(pp=2, dp=ranks // 2)):
            s.apply(plan)
            s.serve(reqs[:4], max_batch=max_batch)  # warm
            cont = s.serve(reqs, max_batch=max_batch, engine="ours")
            auto = s.serve(reqs, max_batch=max_batch)
            if auto.engine != "ours":
                print(row(f"{plan.describe()} / {auto.engine} / continuous", auto, cont))
            print(row(f"{plan.describe()} / ours / continuous", cont, cont))
            print(row(f"{plan.describe()} / ours / static", s.serve(reqs, max_batch=max_batch, engine="ours",
                                                                    policy="static"), cont))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--gap", type=float, default=0.05)
    ap.add_argument("--max-batch", type=int, default=8)
    args = ap.parse_args()
    reqs = requests(args.requests, args.gap)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {len(reqs)} requests, "
          f"one every {args.gap} s, {sum(r.max_new_tokens for r in reqs)} tokens wanted, max_batch {args.max_batch}")
    one_rank(reqs, args.max_batch)
    if args.ranks > 1:
        session(reqs, args.ranks, args.max_batch)


if __name__ == "__main__":
    main()
