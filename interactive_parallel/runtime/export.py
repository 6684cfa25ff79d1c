"""Export a session's model, plan and training settings as a standalone torchrun script.

Owns the text of that script: it starts like every non-engine rank (runtime.launch),
rebuilds the same model (spec), layout (plan) and training knobs from
interactive_parallel.runtime, with no ipyparallel and no notebook, and prints the loss
of each step, so a run set up interactively can be repeated (or scaled out) from a
shell. Knows nothing of the session that asks for it.
"""
from __future__ import annotations

import dataclasses
import pprint

from ..plan import ModelSpec, Plan

_TEMPLATE = '''"""{title}

Run: {run}
Exported by interactive_parallel: the same model, plan and training settings as the
session, rebuilt from interactive_parallel.runtime (no ipyparallel). Rank 0 prints the
loss of each step (the mean over the ranks that see it).
"""
from interactive_parallel.plan import ModelSpec, Plan, check
from interactive_parallel.runtime.launch import Launch, finish
from interactive_parallel.runtime.parallelize import parallelize
from interactive_parallel.runtime.train import make_optimizer, make_scaler, train_step
from interactive_parallel.runtime.verify import global_loss

SPEC = ModelSpec(**{spec})
PLAN = Plan(**{plan})
STEPS = {steps}
TIMEOUT_S = {timeout}


def main() -> None:
    launch = Launch.from_env()
    check(PLAN, launch.world_size, SPEC)  # a bad plan fails here, before any rank waits for another
    device = launch.start(PLAN.device, TIMEOUT_S)
    par = parallelize(SPEC, PLAN, device=device)
    optimizer, scaler = make_optimizer(par), make_scaler(PLAN)
    for step in range(STEPS):
        rec = train_step(par, optimizer, step, scaler=scaler, rank=launch.rank)
        loss = global_loss(par, rec.loss)
        if launch.rank == 0:
            print(f"step {{step}} loss {{loss:.6f}} time_s {{rec.time_s:.3f}}", flush=True)
    finish()


if __name__ == "__main__":
    main()
'''


def run_line(world: int, per_host: list[int] | None = None) -> str:
    """How to start the script: one torchrun on one host, or one per host (rank 0's host first)."""
    if not per_host or len(per_host) == 1:
        return f"torchrun --nproc_per_node {world} {{this file}}"
    nodes = len(per_host)
    lines = [f"torchrun --nnodes {nodes} --node_rank {i} --nproc_per_node {n} --master_addr <host 0> "
             f"--master_port 29500 {{this file}}" for i, n in enumerate(per_host)]
    return f"on each of the {nodes} hosts, rank 0's host first:\n    " + "\n    ".join(lines)


def script_text(spec: ModelSpec, plan: Plan, steps: int, *, timeout_s: float = 120.0,
                per_host: list[int] | None = None) -> str:
    """Python source of a torchrun script training `steps` steps (`per_host`: ranks on each host,
    when the session spans hosts)."""
    if steps < 1:
        raise ValueError(f"steps({steps}) must be >= 1")
    spec_dict = pprint.pformat(dataclasses.asdict(spec), indent=4, width=100, sort_dicts=False)
    plan_dict = pprint.pformat(plan.to_dict(), indent=4, width=100, sort_dicts=False)
    return _TEMPLATE.format(title=f"{spec.name} under {plan.describe()}: {steps} training steps",
                            run=run_line(plan.world_size, per_host), spec=spec_dict, plan=plan_dict, steps=int(steps),
                            timeout=float(timeout_s))
