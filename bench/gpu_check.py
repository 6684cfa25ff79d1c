"""The CUDA path on one GPU: one-rank NCCL parity, and step time against plain torchrun.

Prints two tables:
- parity: a Session with one rank on the GPU (NCCL process group, one rank) trains 3 steps;
  the same 3 steps run in this process on the CPU (the oracle); per step |dloss|, the final
  weights' max |dw|, and verify() on the GPU (the plan against a one-process reference on
  the same device), each against the package's fp32 tolerances;
- step time: the Session's `train(steps=N)` per step (client wall time / N: with its defaults,
  then with no snapshots, probes on and off) against a plain torchrun loop, which takes no
  snapshots either (bench/_plain_torchrun.py: torch and transformers only, run by this venv's
  torchrun, since a lent GPU machine has no network), on the same model config, batch and device.

Needs a GPU: without one it says so and exits 2. `--device cpu` runs the same checks with
gloo on the CPU, which only shows the script itself works (no GPU figure). Numbers move with
machine load.
    python bench/gpu_check.py [--model small-llama] [--steps 20] [--repeats 3] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_session import train_step_s  # this folder: the same timing as the Session bench
from interactive_parallel import Plan, Session
from interactive_parallel.runtime import api

BATCH = dict(batch_size=8, seq_len=64)
PARITY_STEPS = 3
WARMUP = 3
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4  # the parity tests' fp32 tolerances


def cpu_reference(model: str) -> dict:
    """PARITY_STEPS steps in this process on the CPU: losses and final weights."""
    from interactive_parallel.plan import resolve_model
    from interactive_parallel.runtime.parallelize import parallelize
    from interactive_parallel.runtime.train import make_optimizer, train_step

    par = parallelize(resolve_model(model), Plan(**BATCH))
    opt = make_optimizer(par)
    losses = [train_step(par, opt, step).loss for step in range(PARITY_STEPS)]
    return {"losses": losses, "weights": par.full_state_dict()}


def session_numbers(device: str, model: str, steps: int, repeats: int) -> dict:
    """One rank on `device`: the parity run from the seed, verify(), then step times."""
    out: dict = {}
    with Session(ranks=1, device=device) as s:
        out["backend"] = s.doctor()[0].backend
        s.load_model(model)
        s.apply(Plan(device=device, **BATCH))
        out["losses"] = [r.loss for r in s.train(steps=PARITY_STEPS)]
        out["weights"] = s.run(api.full_state_dict)[0]
        out["verify"] = s.verify()
        # The plain loop takes no snapshots: the Session is timed without them too, and with
        # its default (one per 20 steps) beside, so neither hides the other's cost.
        out["step_default"] = train_step_s(s, steps, repeats)
        for probes in (True, False):
            s.set_probes(probes)
            out[f"step_probes_{'on' if probes else 'off'}"] = train_step_s(s, steps, repeats, snapshot_every=0)
    return out


def plain_torchrun(device: str, model: str, steps: int, repeats: int) -> float:
    torchrun = Path(sys.executable).with_name("torchrun")
    cfg = json.dumps(dict(BATCH, device=device, model=model, steps=steps, repeats=repeats, warmup=WARMUP))
    out = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=1",
                          str(Path(__file__).with_name("_plain_torchrun.py")), cfg],
                         env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")),
                         capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"plain torchrun failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])["step_s"]


def report(args, ours: dict, ref: dict, plain_s: float) -> str:
    dloss = [abs(a - b) for a, b in zip(ours["losses"], ref["losses"])]
    dw = max(float((ours["weights"][k].float() - ref["weights"][k].float()).abs().max()) for k in ref["weights"])
    v = ours["verify"]
    ok = lambda good: "ok" if good else "OVER"  # noqa: E731
    rows = [f"{args.model} on {args.device} ({ours['backend']}, 1 rank), batch {BATCH['batch_size']}x"
            f"{BATCH['seq_len']}, fp32",
            "parity against one CPU process, 3 AdamW steps from the same seed:",
            *[f"  step {i} |dloss|            {d:.2e}  (tol {LOSS_TOL:.0e}) {ok(d <= LOSS_TOL)}"
              for i, d in enumerate(dloss)],
            f"  weights max |dw|        {dw:.2e}  (tol {WEIGHT_TOL:.0e}) {ok(dw <= WEIGHT_TOL)}",
            f"  verify() on {args.device}: |dloss| {v.dloss:.2e}, max |dgrad| {v.max_grad_diff:.2e}: "
            f"{'OK' if v.ok else 'MISMATCH'}",
            f"step time, median of {args.repeats} x {args.steps} steps:",
            f"  Session train(), defaults    {ours['step_default'] * 1e3:8.2f} ms  (probes on, snapshots)",
            f"  Session train(), probes on   {ours['step_probes_on'] * 1e3:8.2f} ms  (no snapshots, as the plain loop)",
            f"  Session train(), probes off  {ours['step_probes_off'] * 1e3:8.2f} ms  (no snapshots)",
            f"  plain torchrun loop          {plain_s * 1e3:8.2f} ms"
            f"  (Session / plain: {ours['step_probes_off'] / plain_s:.2f}x probes off)"]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no GPU visible to torch: nothing measured (the CUDA path stays unmeasured)", file=sys.stderr)
            return 2
    ours = session_numbers(args.device, args.model, args.steps, args.repeats)
    ref = cpu_reference(args.model)
    plain_s = plain_torchrun(args.device, args.model, args.steps, args.repeats)
    print(report(args, ours, ref, plain_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
