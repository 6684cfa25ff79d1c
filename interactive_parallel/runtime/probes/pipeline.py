"""Compute intervals of a step as PipelineEvents: forward / backward per stage and microbatch.

Owns how compute is timed. Under PP, each torch.distributed.pipelining stage of the
schedule (`Parallelized.schedule`: `_stages` or `_stage`) gets its `forward_one_chunk`,
`backward_one_chunk` and `backward_weight_one_chunk` wrapped once: an event is the call's
host time (time.time, the clock of the comm ledger), so it covers the stage's compute
and not the schedule's waits for p2p. Action 'B' is a full backward, or the input-grad
half when the schedule splits it ('W' is then the weight half).
Without PP the whole model is stage 0 and a microbatch is one accumulation micro-step:
a forward pre-hook / hook on the module that computes logits gives 'F'; a hook on the
logits' gradient (backward reaches the model) and an autograd engine callback (backward
finished) give 'B'.

Does not know the schedule's plan of actions (it sees what ran), nor comm time inside a
stage (TP/FSDP collectives show up as CommRecords in the same interval).
"""
from __future__ import annotations

import functools
import time

import torch

from ...records import PipelineEvent

_ACTIVE: list["Events"] = []


class Events:
    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step
        self.events: list[PipelineEvent] = []
        self.micro = 0

    def add(self, stage: int, microbatch: int, action: str, start: float, end: float) -> None:
        self.events.append(PipelineEvent(rank=self.rank, step=self.step, stage=int(stage),
                                         microbatch=int(microbatch), action=action, start=start, end=end))


def _wrap_stage_method(stage, name: str, action_of) -> None:
    orig = getattr(stage, name, None)
    if orig is None:
        return

    @functools.wraps(orig)
    def timed(*args, **kwargs):
        rec = _ACTIVE[-1] if _ACTIVE else None
        if rec is None:
            return orig(*args, **kwargs)
        t0 = time.time()
        out = orig(*args, **kwargs)
        chunk = args[0] if args else next(iter(kwargs.values()), 0)
        rec.add(stage.stage_index, chunk, action_of(kwargs), t0, time.time())
        return out

    setattr(stage, name, timed)


def schedule_stages(schedule) -> list:
    stages = getattr(schedule, "_stages", None)
    if stages:
        return list(stages)
    one = getattr(schedule, "_stage", None)
    return [one] if one is not None else []


def instrument_schedule(schedule) -> None:
    """Wrap the stage methods once (idempotent); events flow only while a step is recorded."""
    for stage in schedule_stages(schedule):
        if getattr(stage, "_ip_timed", False):
            continue
        _wrap_stage_method(stage, "forward_one_chunk", lambda kw: "F")
        _wrap_stage_method(stage, "backward_one_chunk", lambda kw: "B")
        _wrap_stage_method(stage, "backward_weight_one_chunk", lambda kw: "W")
        stage._ip_timed = True


def _logits(out):
    if isinstance(out, torch.Tensor):
        return out
    return getattr(out, "logits", None)


def instrument_module(module: torch.nn.Module) -> None:
    """Whole-model compute as stage 0: F per forward, B per backward through it (once per module)."""
    if getattr(module, "_ip_timed", False):
        return
    starts: list[float] = []

    def pre(_mod, _args):
        if _ACTIVE:
            starts.append(time.time())

    def post(_mod, _args, out):
        rec = _ACTIVE[-1] if _ACTIVE else None
        if rec is None or not starts:
            return
        mb, t0 = rec.micro, starts.pop()
        rec.micro += 1
        rec.add(0, mb, "F", t0, time.time())
        logits = _logits(out)
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            def on_grad(grad):
                b0 = time.time()
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: rec.add(0, mb, "B", b0, time.time()))
                return grad

            logits.register_hook(on_grad)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
    module._ip_timed = True


class recording:
    def __init__(self, rank: int, step: int):
        self.events = Events(rank, step)

    def __enter__(self) -> Events:
        _ACTIVE.append(self.events)
        return self.events

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self.events)
