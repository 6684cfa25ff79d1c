"""A plain torchrun worker with the same model, plan and batch as the Session bench.

Prints, from rank 0, a JSON line: seconds from launch to a ready process group, to a
built model, and the median step time. Launched by bench_session.py.
"""
import json
import os
import statistics
import sys
import time

T_LAUNCH = float(os.environ["BENCH_T0"])
import torch  # noqa: E402,F401 - imported first: its cost is part of what is timed
import torch.distributed as dist  # noqa: E402

from interactive_parallel.plan import Plan, resolve_model  # noqa: E402
from interactive_parallel.runtime import dist as rdist  # noqa: E402
from interactive_parallel.runtime.parallelize import parallelize  # noqa: E402
from interactive_parallel.runtime.train import make_optimizer, train_step  # noqa: E402

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
rdist.set_identity(rank, world, int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
dist.init_process_group("gloo")
dist.barrier()
t_pg = time.time() - T_LAUNCH
plan = Plan(dp=world, batch_size=8, seq_len=64)
par = parallelize(resolve_model("tiny-llama"), plan)
opt = make_optimizer(par)
dist.barrier()
t_model = time.time() - T_LAUNCH
times = []
for step in range(int(sys.argv[1])):
    dist.barrier()
    t = time.perf_counter()
    train_step(par, opt, step)
    dist.barrier()
    times.append(time.perf_counter() - t)
if rank == 0:
    print(json.dumps({"ready": t_pg, "model": t_model, "step": statistics.median(times[2:])}), flush=True)
dist.destroy_process_group()
