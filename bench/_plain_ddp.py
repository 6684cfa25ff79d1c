"""A plain DDP loop as a newcomer writes it: torch, transformers and DDP, none of this package's
runtime but its batches (each rank makes its rows of the same global batch every step, as
the Session's ranks do, so batch making is inside the timed loop on both sides).

The baseline bench_session.py sets the Session's `train(steps=20)` against: the same model
shape, batch, fp32 AdamW, one thread per rank, `steps` steps timed end to end between two
barriers, `repeats` times. Rank 0 prints one JSON line: {"step_s": median seconds per step}.
    torchrun --standalone --nproc_per_node 4 bench/_plain_ddp.py '{"steps": 20, ...}'
"""
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoModelForCausalLM

from interactive_parallel.plan import resolve_model
from interactive_parallel.runtime.training.data import local_batch

cfg = json.loads(sys.argv[1])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
config = dict(resolve_model(cfg.get("model", "tiny-llama")).config)
torch.manual_seed(0)
model = DDP(AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(i: int) -> None:
    ids = local_batch(0, i, cfg["batch_size"], cfg["seq_len"], rank, world)
    loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


i = 0
for _ in range(cfg["warmup"]):
    step(i)
    i += 1
times = []
for _ in range(cfg["repeats"]):
    dist.barrier()
    t = time.perf_counter()
    for _ in range(cfg["steps"]):
        step(i)
        i += 1
    dist.barrier()
    times.append((time.perf_counter() - t) / cfg["steps"])
if rank == 0:
    print(json.dumps({"step_s": statistics.median(times)}), flush=True)
dist.destroy_process_group()
