"""A plain torchrun worker: the same model, plans, batch and train_step as the Session bench.

For each plan (JSON on the command line): lay the model out, run the warm-up steps, then time
`steps` steps end to end between two barriers, `repeats` times. Rank 0 prints one JSON line,
plan -> median seconds per step. Launched by bench_session.py.
"""
import json
import statistics
import sys
import time

import torch.distributed as dist

from interactive_parallel.plan import Plan, resolve_model
from interactive_parallel.runtime.groups.launch import finish, init_from_env
from interactive_parallel.runtime.layout.parallelize import parallelize
from interactive_parallel.runtime.training.train import make_optimizer, train_step

cfg = json.loads(sys.argv[1])
launch, device = init_from_env("cpu", timeout_s=120.0)
rank = launch.rank
spec = resolve_model(cfg.get("model", "tiny-llama"))  # a preset name or a config dict
out = {}
for name, fields in cfg["plans"].items():
    par = parallelize(spec, Plan(**fields), device=device)
    opt = make_optimizer(par)
    step = 0
    for _ in range(cfg["warmup"]):
        train_step(par, opt, step, rank=rank)
        step += 1
    per_step = []
    for _ in range(cfg["repeats"]):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(cfg["steps"]):
            train_step(par, opt, step, rank=rank)
            step += 1
        dist.barrier()
        per_step.append((time.perf_counter() - t) / cfg["steps"])
    out[name] = statistics.median(per_step)
if rank == 0:
    print(json.dumps(out), flush=True)
finish()
