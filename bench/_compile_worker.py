"""A torchrun worker for bench_compile.py: one model, one plan, eager then compiled.

For each of eager and compiled: lay the model out, time `steps` training steps one by one
between barriers (rank 0's clock), and take the activations the memory probe measured on the
last step. Rank 0 prints one JSON line. The compile cache is the fresh directory the launcher
names in TORCHINDUCTOR_CACHE_DIR, so the first compiled step compiles from cold.
"""
import json
import sys
import time

import torch.distributed as dist

from interactive_parallel.plan import Plan, resolve_model
from interactive_parallel.runtime.groups.launch import finish, init_from_env
from interactive_parallel.runtime.layout.parallelize import parallelize
from interactive_parallel.runtime.rank import state
from interactive_parallel.runtime.training.train import make_optimizer, train_step

cfg = json.loads(sys.argv[1])
launch, device = init_from_env("cpu", timeout_s=900.0)
spec = resolve_model(cfg["model"])
out = {}
for compiled in (False, True):
    par = parallelize(spec, Plan(**cfg["plan"], compile=compiled), device=device)
    opt = make_optimizer(par)
    times, rec = [], None
    for step in range(cfg["steps"]):
        dist.barrier()
        t = time.perf_counter()
        rec = train_step(par, opt, step, rank=launch.rank)
        dist.barrier()
        times.append(time.perf_counter() - t)
    out["compiled" if compiled else "eager"] = {"times": times, "activations": rec.memory.activations,
                                                "loss": rec.loss}
    state.get().reset_model()
if launch.rank == 0:
    print(json.dumps(out), flush=True)
finish()
