"""The Session against plain torchrun, bare ipyparallel and accelerate's notebook_launcher, in one run.

Prints one table of medians and the ratios docs/measured.md quotes:
- step time inside `train(steps=20)` (client wall time / 20: call, streaming and the ranks' stop
  agreement included) against the same `train_step` loop under plain torchrun (20 steps timed
  end to end between two barriers), per plan, probes at their default; with the session's
  default snapshots (one per 20 steps) and without them;
- a warm `apply(new plan)` + `train(steps=20)` against one `notebook_launcher` call that forks 4
  processes, rendezvouses, builds the same model shape and runs 20 DDP steps on the same batch
  (accelerate is needed for this row only: `pip install accelerate`; it is not a dependency);
- a no-op call to every rank against bare ipyparallel `apply_sync`;
- the dp4 step against a plain DDP loop as a newcomer writes it (bench/_plain_ddp.py: no probes,
  no records, no stop vote, the same batches made each step), with the probes on (the default)
  and off (`set_probes(False)`), so the table says what the probes and the rest cost.

Numbers move with machine load: run it on an otherwise idle machine, with several rounds (the
three are measured one after another in each; a ratio is taken within a round).
    python bench/bench_session.py [--ranks 4] [--steps 20] [--repeats 3] [--rounds 3]
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

PLANS = {"dp4": dict(dp=4), "fsdp4": dict(fsdp=4), "dp2xtp2": dict(dp=2, tp=2), "pp2xdp2": dict(pp=2, dp=2)}
BATCH = dict(batch_size=8, seq_len=64)
WARMUP = 3


def median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def train_step_s(s: Session, steps: int, repeats: int, snapshot_every: int | None = None) -> float:
    """Median over `repeats` of the client's wall time of train(steps) / steps, after a warm-up
    (snapshot_every None: the session's default, one snapshot per call of 20 steps)."""
    s.train(steps=WARMUP, snapshot_every=0)
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        s.train(steps=steps, snapshot_every=snapshot_every)
        walls.append((time.perf_counter() - t) / steps)
    return statistics.median(walls)


def session_numbers(s: Session, plans: list[str], steps: int, repeats: int) -> dict:
    out: dict = {}
    s.load_model("tiny-llama")
    for name in plans:
        s.apply(Plan(**PLANS[name], **BATCH))
        out[f"step_{name}"] = train_step_s(s, steps, repeats) * 1e3
        out[f"step_{name}_nosnap"] = train_step_s(s, steps, repeats, snapshot_every=0) * 1e3
        if name == "dp4":
            s.set_probes(False)
            out["step_dp4_noprobes"] = train_step_s(s, steps, repeats, snapshot_every=0) * 1e3
            s.set_probes(True)
    # warm re-plan: the ranks hold a model under another plan; lay it out anew and train
    replans = []
    for _ in range(repeats):
        s.apply(Plan(**PLANS["dp2xtp2"], **BATCH))
        t = time.perf_counter()
        s.apply(Plan(**PLANS["dp4"], **BATCH))
        s.train(steps=steps)
        replans.append(time.perf_counter() - t)
    out["replan_train_s"] = statistics.median(replans)
    out["noop_ms"] = median_ms(lambda: s.run(int), 50)
    out["ipp_noop_ms"] = median_ms(lambda: s.view.apply_sync(int), 50)
    return out


def torchrun_numbers(ranks: int, plans: list[str], steps: int, repeats: int, *, table: dict = PLANS,
                     batch: dict = BATCH, model="tiny-llama") -> dict:
    """Median ms per step of each plan (named in `table`) under plain torchrun, same train_step."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    spec = json.dumps({"plans": {n: dict(table[n], **batch) for n in plans}, "steps": steps, "warmup": WARMUP,
                       "repeats": repeats, "model": model})
    out = subprocess.run([str(torchrun), "--standalone", f"--nproc_per_node={ranks}",
                          str(Path(__file__).with_name("_torchrun_worker.py")), spec],
                         env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(out.stderr[-3000:])
    found = {f"step_{k}": v * 1e3 for k, v in json.loads(lines[-1]).items()}
    if "dp4" in plans and ranks == 4 and model == "tiny-llama":
        found["step_plain_ddp"] = plain_ddp_ms(torchrun, env, steps, repeats)
    return found


def plain_ddp_ms(torchrun: Path, env: dict, steps: int, repeats: int) -> float:
    spec = json.dumps({"steps": steps, "warmup": WARMUP, "repeats": repeats, **BATCH})
    out = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=4",
                          str(Path(__file__).with_name("_plain_ddp.py")), spec],
                         env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(lines[-1])["step_s"] * 1e3


def _launched(config: dict, steps: int, batch: dict) -> None:
    """One notebook_launcher process: accelerate's own DDP set-up on the tiny-llama shape."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoModelForCausalLM

    from interactive_parallel.runtime.training.data import global_batch, local_slice

    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    kwargs = dict(config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kwargs.pop("model_type"), **kwargs))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    for step in range(steps):
        ids = local_slice(global_batch(0, step, batch["batch_size"], batch["seq_len"]), acc.process_index,
                          acc.num_processes)
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()


def launcher_numbers(ranks: int, steps: int, repeats: int) -> dict:
    try:
        from accelerate import notebook_launcher
    except ImportError:
        return {}
    import transformers.models.llama.modeling_llama  # noqa: F401 - imported in the parent, as in a notebook

    from interactive_parallel.plan import PRESETS

    config = PRESETS["tiny-llama"].config
    calls = []
    for _ in range(repeats):
        t = time.perf_counter()
        notebook_launcher(_launched, (config, steps, BATCH), num_processes=ranks, use_port=str(29500 + len(calls)))
        calls.append(time.perf_counter() - t)
    return {"replan_train_s": statistics.median(calls)}


def launcher_in_child(args) -> dict:
    """launcher_numbers in a fresh process of its own: notebook_launcher forks its caller, which
    must run no threads (a Session's zmq and BLAS threads may hold locks a forked child then
    waits on forever: seen, one call in three)."""
    out = subprocess.run([sys.executable, __file__, "--launcher-only", "--ranks", str(args.ranks), "--steps",
                          str(args.steps), "--repeats", str(args.repeats)], capture_output=True, text=True,
                         timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def one_round(args) -> tuple[dict, dict, dict]:
    """notebook_launcher, then a Session, then plain torchrun: (launcher, ours, theirs)."""
    launcher = launcher_in_child(args)
    print("notebook_launcher:", json.dumps(launcher), file=sys.stderr, flush=True)  # progress, part by part
    with Session(ranks=args.ranks) as s:
        ours = session_numbers(s, args.plans, args.steps, args.repeats)
    print("Session:", json.dumps(ours), file=sys.stderr, flush=True)
    theirs = torchrun_numbers(args.ranks, args.plans, args.steps, args.repeats)
    print("torchrun:", json.dumps(theirs), file=sys.stderr, flush=True)
    theirs.update({f"step_{p}_nosnap": theirs[f"step_{p}"] for p in args.plans})
    return launcher, ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of all three, one after another; ratios are taken within a round (the "
                         "machine's load drifts over minutes) and their median is printed")
    ap.add_argument("--plans", nargs="+", default=list(PLANS))
    ap.add_argument("--launcher-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.launcher_only:
        print(json.dumps(launcher_numbers(args.ranks, args.steps, args.repeats)), flush=True)
        return
    rounds = [one_round(args) for _ in range(args.rounds)]
    print(f"tiny-llama, {args.ranks} ranks, batch 8x64, {args.steps} steps, {os.cpu_count()} cores, "
          f"medians of {args.repeats} in each of {args.rounds} round(s); ratio: median of the rounds' ratios")
    print(f"{'':44s}{'Session':>10s}{'baseline':>10s}{'ratio':>8s}  baseline (each round's ratio)")
    rows = [(f"step in train(steps={args.steps}), {p}, ms", f"step_{p}", 2, "plain torchrun") for p in args.plans]
    rows += [(f"  the same, snapshot_every=0, {p}, ms", f"step_{p}_nosnap", 2, "plain torchrun") for p in args.plans]
    if "dp4" in args.plans and args.ranks == 4:
        rows += [(f"step in train(steps={args.steps}), dp4, ms", "step_dp4", "plain_ddp", "plain DDP loop"),
                 ("  the same, probes off, no snapshots, ms", "step_dp4_noprobes", "plain_ddp", "plain DDP loop")]
    rows += [(f"warm apply + train(steps={args.steps}), s", "replan_train_s", 0, "notebook_launcher"),
             ("no-op call to all ranks, ms", "noop_ms", None, "ipyparallel apply_sync")]
    for label, key, side, what in rows:
        mine = [ours[key] for _, ours, _ in rounds]
        base = [(r[2].get("step_plain_ddp") if side == "plain_ddp" else r[side].get(key) if side is not None
                 else r[1]["ipp_noop_ms"]) for r in rounds]
        ratios = [m / b for m, b in zip(mine, base) if b]
        b = statistics.median([x for x in base if x]) if any(base) else float("nan")
        ratio = f"{statistics.median(ratios):8.2f}" if ratios else f"{'-':>8s}"
        each = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"{label:44s}{statistics.median(mine):10.2f}{b:10.2f}{ratio}  {what} ({each})")
    over = [ours["noop_ms"] - ours["ipp_noop_ms"] for _, ours, _ in rounds]
    print(f"no-op call overhead over bare apply_sync: {statistics.median(over):+.2f} ms "
          f"({', '.join(f'{x:+.2f}' for x in over)})")


if __name__ == "__main__":
    main()
