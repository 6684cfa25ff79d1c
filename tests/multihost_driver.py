"""The client of the multi-host test: runs on the controller's host, attaches, reports as JSON.

Run: python multihost_driver.py PROFILE_DIR CLUSTER_ID RANKS OUT_JSON [--interface NAME] [--export PATH]

Attaches a Session to the cluster the test started across network namespaces, then: what
each rank bound to and what it listens on, the clock offsets, 3 dp2 x tp2 training steps
with the losses and final weights of the same run in this process alone (the parity
oracle), verify(), greedy generation here and there, the latest step's timeline per rank
(on the client's clock and raw), and the exported torchrun script. Writes every number to
OUT_JSON (or the traceback, exiting 1). Knows nothing of namespaces.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback

PLAN = dict(dp=2, tp=2, batch_size=8, seq_len=32)
STEPS = 3
PROMPTS = ["12+35=", "7+8="]
NEW_TOKENS = 4


def reference() -> dict:
    """The same training in this process alone, and its greedy completions afterwards."""
    from interactive_parallel.plan import PRESETS, Plan
    from interactive_parallel.runtime.inference.generate import generate
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.training.train import make_optimizer, train_step
    from interactive_parallel.runtime.training.verify import reference_plan

    par = parallelize(PRESETS["tiny-llama"], reference_plan(Plan(**PLAN)))
    opt = make_optimizer(par)
    losses = [train_step(par, opt, step).loss for step in range(STEPS)]
    out = {"losses": losses, "weights": par.full_state_dict(), "generated": generate(par, PROMPTS, NEW_TOKENS)}
    out["next_loss"] = train_step(par, opt, STEPS).loss  # where an exported script resumes
    return out


def step_spans(timeline) -> dict[int, list[float]]:
    """Per rank: [first comm start, last comm end] of the latest step."""
    from interactive_parallel.records import CommRecord

    spans: dict[int, list[float]] = {}
    for rec in timeline:
        if isinstance(rec, CommRecord):
            lo, hi = spans.get(rec.rank, [rec.start, rec.end])
            spans[rec.rank] = [min(lo, rec.start), max(hi, rec.end)]
    return spans


def drive(args) -> dict:
    import multihost_ranks
    from interactive_parallel import Plan, Session
    from interactive_parallel.runtime import api

    out: dict = {}
    with Session.attach(cluster_id=args.cluster_id, profile_dir=args.profile_dir, ranks=args.ranks,
                        interface=args.interface, timeout=180.0, collective_timeout=60.0) as s:
        out["info"] = [{k: getattr(r, k) for k in ("rank", "host", "local_rank", "interface", "address", "launcher_rank")}
                       for r in s.ranks_info]
        out["clocks"] = [c.to_dict() for c in s.clocks()]
        out["listening"] = s.run(multihost_ranks.listening)
        out["doctor"] = [r.to_dict() for r in s.doctor()]
        s.load_model("tiny-llama")
        s.apply(Plan(**PLAN))
        records = s.train(steps=STEPS)
        losses = {}
        for r in records:
            losses.setdefault(r.step, []).append(r.loss)
        out["losses"] = [sum(v) / len(v) for _, v in sorted(losses.items())]
        out["timeline"] = step_spans(s.timeline())
        out["timeline_raw"] = step_spans(s.timeline(raw=True))
        weights = s.run(api.full_state_dict)[0]
        report = s.verify()
        out["verify"] = {"ok": report.ok, "dloss": report.dloss, "max_grad_diff": report.max_grad_diff}
        out["generated"] = s.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        if args.export:  # the script resumes the session's state: its first step is step STEPS
            out["export"] = s.export_script(args.export, steps=1)
    ref = reference()
    out["ref_losses"] = ref["losses"]
    out["ref_generated"] = ref["generated"]
    out["ref_next_loss"] = ref["next_loss"]
    out["weight_diff"] = max(float((weights[k] - ref["weights"][k]).abs().max()) for k in ref["weights"])
    out["weight_names_differ"] = sorted(set(weights) ^ set(ref["weights"]))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("profile_dir")
    parser.add_argument("cluster_id")
    parser.add_argument("ranks", type=int)
    parser.add_argument("out")
    parser.add_argument("--interface")
    parser.add_argument("--export")
    args = parser.parse_args(argv)
    try:
        result, code = drive(args), 0
    except BaseException:  # noqa: BLE001 - the test reads the traceback from the file
        result, code = {"error": traceback.format_exc()}, 1
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
