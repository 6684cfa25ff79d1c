"""What keeping the training state costs: memory while loading, re-plans, snapshots.

Prints three tables:
- load: peak RSS per rank while a ~300 M-parameter Llama config is laid out under fsdp=4
  (plain torchrun, bench/_state_worker.py), beyond the rank's RSS just before, as a
  fraction of the model's fp32 bytes (target <= 0.35), beside building the whole model
  in one process (runtime.model.models.build_model), which is what every rank did before the
  meta-device build;
- save_pretrained: peak RSS per rank while a Session writes the same model, laid out under
  fsdp=4, as a transformers directory (Session.save_pretrained: each rank's pieces, then
  torch's consolidation), beyond the rank's RSS just before, as the same fraction (target
  <= 0.35), and the seconds it took;
- re-plan: a warm `apply(dp4)` from dp2xtp2 and `apply + train(steps=20)` in a 4-rank
  Session (tiny-llama, batch 8x64), without snapshots and with the default interval; compare
  with accelerate's notebook_launcher in bench_session.py;
- snapshot: one snapshot of weights and AdamW state (torch.distributed.checkpoint to the
  session's tmpfs scratch directory) per plan and model: seconds, bytes on tmpfs (the
  memory a snapshot holds; the previous generation is removed once the next is complete),
  and the same as a number of training steps.

Numbers move with machine load: run it on an otherwise idle machine.
    python bench/bench_state.py [--repeats 3] [--skip-load] [--skip-save] [--only-save]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from interactive_parallel import Plan, Session
from interactive_parallel.cluster.model_ops import SNAPSHOT_EVERY
from interactive_parallel.records import ScratchLayout
from interactive_parallel.runtime import api
from interactive_parallel.runtime.probes.memory import peak_rss, reset_peak_rss

LLAMA_300M = dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                  num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=16,
                  max_position_embeddings=2048, tie_word_embeddings=False)
WARM = dict(LLAMA_300M, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4)
BATCH = dict(batch_size=8, seq_len=64)
SNAPSHOT_PLANS = {"dp4": dict(dp=4), "fsdp4": dict(fsdp=4), "dp2xtp2": dict(dp=2, tp=2), "pp2xdp2": dict(pp=2, dp=2)}


def params(config: dict) -> int:
    from interactive_parallel.plan.estimate import param_inventory
    from interactive_parallel.plan.models import spec_from_config_dict

    return sum(math.prod(p.shape) for p in param_inventory(spec_from_config_dict(config)))


def load_numbers() -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    cfg = json.dumps({"config": LLAMA_300M, "warm": WARM, "plan": {"fsdp": 4}, "whole": True})
    out = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=4",
                          str(Path(__file__).with_name("_state_worker.py")), cfg],
                         env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("[")]
    if not lines:
        raise RuntimeError(out.stderr[-3000:])
    return {"rows": json.loads(lines[-1]), "model_bytes": 4 * params(LLAMA_300M)}


def save_numbers(s: Session) -> dict:
    """Peak RSS per rank (beyond its RSS before) and seconds of one save_pretrained of LLAMA_300M
    under fsdp=4; a warm-up save of the small config first (imports, one-off set-up)."""
    with tempfile.TemporaryDirectory() as tmp:
        s.load_model(WARM)
        s.apply(Plan(fsdp=4, **BATCH))
        s.save_pretrained(os.path.join(tmp, "warm"))
        s.load_model(LLAMA_300M)
        s.apply(Plan(fsdp=4, **BATCH))
        before = s.run(reset_peak_rss)
        t = time.perf_counter()
        out = s.save_pretrained(os.path.join(tmp, "measured"))
        seconds = time.perf_counter() - t
        peaks = s.run(peak_rss)
        on_disk = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    return {"grew": [p - b for p, b in zip(peaks, before)], "seconds": seconds, "bytes": on_disk,
            "model_bytes": 4 * params(LLAMA_300M)}


def replan_numbers(s: Session, repeats: int) -> dict:
    s.load_model("tiny-llama")
    s.apply(Plan(dp=4, **BATCH))
    s.train(steps=3, snapshot_every=0)
    out = {}
    for every in (0, SNAPSHOT_EVERY):
        applies, totals = [], []
        for _ in range(repeats):
            s.apply(Plan(dp=2, tp=2, **BATCH))
            s.train(steps=2, snapshot_every=0)  # AdamW has state to carry
            t = time.perf_counter()
            s.apply(Plan(dp=4, **BATCH))
            applies.append(time.perf_counter() - t)
            s.train(steps=20, snapshot_every=every)
            totals.append(time.perf_counter() - t)
        out[every] = (statistics.median(applies), statistics.median(totals))
    return out


def snapshot_numbers(s: Session, repeats: int) -> list[tuple]:
    rows = []
    for model in ("tiny-llama", "small-llama"):
        s.load_model(model)
        for name, fields in SNAPSHOT_PLANS.items():
            s.apply(Plan(**fields, **BATCH))
            steps = s.train(steps=4, snapshot_every=0)
            step_s = statistics.median(r.time_s for r in steps if r.step > min(x.step for x in steps))
            taken = [s.run(api.take_snapshot, ScratchLayout(s.model.scratch.path))[0] for _ in range(repeats)]
            seconds = statistics.median(t.seconds for t in taken)
            rows.append((model, name, seconds, taken[-1].bytes, step_s))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--skip-save", action="store_true")
    ap.add_argument("--only-save", action="store_true", help="the save_pretrained table alone")
    args = ap.parse_args()
    print(f"{os.cpu_count()} cores; medians of {args.repeats}")
    if not args.skip_load and not args.only_save:
        load = load_numbers()
        mb = load["model_bytes"]
        print(f"\nload: Llama {params(LLAMA_300M) / 1e6:.0f} M parameters ({mb / 2**20:,.0f} MiB fp32) under fsdp=4")
        print(f"{'rank':>6s}{'peak - before, MiB':>22s}{'x model bytes':>16s}")
        for r in load["rows"]:
            grew = r["peak"] - r["before"]
            print(f"{r['rank']:>6d}{grew / 2**20:>22,.0f}{grew / mb:>16.3f}")
            if "whole_peak" in r:
                whole = r["whole_peak"] - r["whole_before"]
        print(f"{'whole':>6s}{whole / 2**20:>22,.0f}{whole / mb:>16.3f}   build_model in one process (before)")
    with Session(ranks=4) as s:
        save = None if args.skip_save else save_numbers(s)
        if save is not None:
            mb = save["model_bytes"]
            print(f"\nsave_pretrained: Llama {params(LLAMA_300M) / 1e6:.0f} M parameters under fsdp=4, "
                  f"{save['seconds']:.1f} s, {save['bytes'] / 2**20:,.0f} MiB written")
            print(f"{'rank':>6s}{'peak - before, MiB':>22s}{'x model bytes':>16s}")
            for rank, grew in enumerate(save["grew"]):
                print(f"{rank:>6d}{grew / 2**20:>22,.0f}{grew / mb:>16.3f}")
        if args.only_save:
            return
        replan = replan_numbers(s, args.repeats)
        snaps = snapshot_numbers(s, args.repeats)
    print("\nre-plan dp2xtp2 -> dp4 (tiny-llama, 4 ranks, batch 8x64)")
    for every, (apply_s, total_s) in replan.items():
        print(f"  snapshot_every={every:<3d} apply {apply_s:.3f} s   apply + train(steps=20) {total_s:.3f} s")
    print("\nsnapshot (weights + AdamW state, DCP to tmpfs)")
    print(f"{'model':<13s}{'plan':<9s}{'seconds':>9s}{'MiB':>8s}{'step s':>9s}{'= steps':>9s}")
    for model, name, seconds, nbytes, step_s in snaps:
        print(f"{model:<13s}{name:<9s}{seconds:>9.3f}{nbytes / 2**20:>8.1f}{step_s:>9.3f}{seconds / step_s:>9.1f}")


if __name__ == "__main__":
    main()
