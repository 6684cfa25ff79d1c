"""Export a session's model, plan and training settings as a standalone torchrun script.

Owns the text of that script: it starts like every non-engine rank (runtime.groups.launch),
rebuilds the same model (spec), layout (plan) and training knobs from
interactive_parallel.runtime, with no ipyparallel and no notebook, resumes the weights,
optimizer state and step the session saved beside it (a torch.distributed.checkpoint
directory; without one it starts from the seed), reads the text the session trained on
(its DataSource; the synthetic task without one), and prints the loss of each step, so a
run set up and trained interactively continues (or scales out) from a shell. A derived
family's facts are not written out: the script derives them again from the config
(runtime.layout.parallelize does). Knows nothing of the session that asks for it.
"""
from __future__ import annotations

import dataclasses
import pprint

from ...plan import ModelSpec, Plan
from ...records import DataSource

_TEMPLATE = '''"""{title}

Run: {run}
Exported by interactive_parallel: the same model, plan and training settings as the
session, rebuilt from interactive_parallel.runtime (no ipyparallel), resuming the
weights, optimizer state and step saved in STATE_DIR beside this file. Rank 0 prints the
loss of each step (the mean over the ranks that see it).
"""
import os

from interactive_parallel.plan import ModelSpec, Plan, check
from interactive_parallel.records import DataSource
from interactive_parallel.runtime.checkpoints.checkpoint import load
from interactive_parallel.runtime.groups.launch import Launch, finish
from interactive_parallel.runtime.layout.parallelize import parallelize
from interactive_parallel.runtime.training.data import reading
from interactive_parallel.runtime.training.train import make_optimizer, make_scaler, train_step
from interactive_parallel.runtime.training.verify import global_loss

SPEC = ModelSpec(**{spec})
PLAN = Plan(**{plan})
STEPS = {steps}
TIMEOUT_S = {timeout}
STATE_DIR = {state_dir!r}  # the session's state at export, beside this file (None: start from the seed)
DATA = {data}  # the text the session trained on (None: the synthetic task)


def main() -> None:
    launch = Launch.from_env()
    check(PLAN, launch.world_size, SPEC)  # a bad plan fails here, before any rank waits for another
    device = launch.start(PLAN.device, TIMEOUT_S)
    state = os.path.join(os.path.dirname(os.path.abspath(__file__)), STATE_DIR) if STATE_DIR else None
    par = parallelize(SPEC, PLAN, device=device, fill="none" if state else "seed")
    optimizer, scaler = make_optimizer(par), make_scaler(PLAN)
    first = load(par, optimizer, state).step if state else 0
    with reading(DATA):
        for step in range(first, first + STEPS):
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
                per_host: list[int] | None = None, state_dir: str | None = None,
                data: DataSource | None = None) -> str:
    """Python source of a torchrun script training `steps` steps (`per_host`: ranks on each host,
    when the session spans hosts), resuming from the checkpoint directory `state_dir` (relative
    to the script) when given, reading `data`'s text (None: the synthetic task)."""
    if steps < 1:
        raise ValueError(f"steps({steps}) must be >= 1")
    spec_dict = pprint.pformat(dataclasses.asdict(dataclasses.replace(spec, facts=None)), indent=4, width=100,
                               sort_dicts=False)
    source = "None" if data is None else f"DataSource(path={data.path!r}, format={data.format!r})"
    plan_dict = pprint.pformat(plan.to_dict(), indent=4, width=100, sort_dicts=False)
    return _TEMPLATE.format(title=f"{spec.name} under {plan.describe()}: {steps} training steps",
                            run=run_line(plan.world_size, per_host), spec=spec_dict, plan=plan_dict, steps=int(steps),
                            timeout=float(timeout_s), state_dir=state_dir, data=source)
