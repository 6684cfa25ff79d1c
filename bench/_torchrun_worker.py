"""A plain torchrun worker: the same model, plans, batch and train_step as the Session bench.

For each plan (JSON on the command line): lay the model out, run the warm-up steps, then time
`steps` steps end to end between two barriers, `repeats` times. Rank 0 prints one JSON line,
plan -> median seconds per step. Launched by bench_session.py.
"""
import json
import os
import statistics
import sys
import time

import torch.distributed as dist

from interactive_parallel.plan import Plan, resolve_model
from interactive_parallel.runtime import dist as rdist
from interactive_parallel.runtime.parallelize import parallelize
from interactive_parallel.runtime.train import make_optimizer, train_step

cfg = json.loads(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
rdist.set_identity(rank, world, int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
dist.init_process_group("gloo")
spec = resolve_model("tiny-llama")
out = {}
for name, fields in cfg["plans"].items():
    par = parallelize(spec, Plan(**fields))
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
dist.barrier()
dist.destroy_process_group()
