"""A plain torchrun worker for bench_state.py: peak RSS per rank while a model is laid out.

Config (JSON on the command line): {"config": transformers config dict, "warm": a small config
of the same family, "plan": Plan fields, "whole": true to also build the whole model the way
every rank did before the meta-device build (runtime.model.models.build_model), on rank 0 only}.
Each rank lays the small model out first (imports and one-off set-up are not counted), resets
the kernel's peak counter (VmHWM, /proc/self/clear_refs), lays the measured model out and
reports VmRSS before and VmHWM after. Rank 0 prints one JSON line with every rank's numbers.
"""
import json
import sys

import torch.distributed as dist

from interactive_parallel.plan import Plan
from interactive_parallel.plan.models import spec_from_config_dict
from interactive_parallel.runtime import api
from interactive_parallel.runtime.groups.launch import finish, init_from_env
from interactive_parallel.runtime.probes.memory import peak_rss, reset_peak_rss
from interactive_parallel.runtime.rank import state

cfg = json.loads(sys.argv[1])
launch, _ = init_from_env("cpu", timeout_s=600.0)
plan = Plan(**cfg["plan"])
api.load_model(spec_from_config_dict(cfg["warm"], name="warm-up"))
api.apply_plan(plan)
api.load_model(spec_from_config_dict(cfg["config"], name="measured"))
before = reset_peak_rss()
api.apply_plan(plan)
mine = {"rank": launch.rank, "before": before, "peak": peak_rss()}
state.get().reset_model()
if cfg.get("whole") and launch.rank == 0:
    from interactive_parallel.runtime.model.models import build_model

    before = reset_peak_rss()
    model = build_model(spec_from_config_dict(cfg["config"], name="measured"))
    mine.update(whole_before=before, whole_peak=peak_rss())
    del model
rows = [None] * launch.world_size
dist.all_gather_object(rows, mine)
if launch.rank == 0:
    print(json.dumps(rows), flush=True)
finish()
