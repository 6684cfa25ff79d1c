"""A plain torchrun training loop: torch and transformers only, none of this package's runtime.

The baseline of bench/gpu_check.py: the same model config (taken from the preset, as data),
batch shape, fp32 and AdamW (torch's default foreach choice), timed end to end between two
synchronizations. Prints one JSON line: {"step_s": median seconds per step, "device": ...}.
    torchrun --standalone --nproc_per_node 1 bench/_plain_torchrun.py '{"model": ..., ...}'
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from interactive_parallel.plan import resolve_model

cfg = json.loads(sys.argv[1])
device = torch.device(cfg["device"], int(os.environ.get("LOCAL_RANK", 0))) if cfg["device"] == "cuda" else \
    torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
config = dict(resolve_model(cfg["model"]).config)
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
vocab = model.config.vocab_size
ids = torch.randint(0, vocab, (cfg["batch_size"], cfg["seq_len"] + 1), device=device)


def sync() -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step() -> None:
    loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(cfg["warmup"]):
    step()
times = []
for _ in range(cfg["repeats"]):
    sync()
    t = time.perf_counter()
    for _ in range(cfg["steps"]):
        step()
    sync()
    times.append((time.perf_counter() - t) / cfg["steps"])
if dist.get_rank() == 0:
    print(json.dumps({"step_s": statistics.median(times), "device": str(device)}), flush=True)
dist.destroy_process_group()
