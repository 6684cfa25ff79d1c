"""Compute intervals of a step as PipelineEvents: forward / backward per stage and microbatch.

Owns how compute is timed. Under PP, each torch.distributed.pipelining stage of the
schedule (`Parallelized.schedule`: `_stages` or `_stage`) gets its `forward_one_chunk`,
`backward_one_chunk` and `backward_weight_one_chunk` wrapped once: an event spans the call,
so it covers the stage's compute and not the schedule's waits for p2p. Action 'B' is a full
backward, or the input-grad half when the schedule splits it ('W' is then the weight half).
Without PP the whole model is stage 0 and a microbatch is one accumulation micro-step:
a forward pre-hook / hook on the module that computes logits gives 'F'; a hook on the
logits' gradient (backward reaches the model) and an autograd engine callback (backward
finished) give 'B'.

`start` / `end` are host time (time.time, the comm ledger's clock: probes/clock.py). On CPU
they are when the call (or hook) ran. On CUDA the host only queues kernels, so they are
marks on the current stream instead, resolved when the step ends: `start` when the device
reached the first of the interval's kernels (after what was queued before it, p2p waits
included), `end` when it finished the last; the engine callback that ends 'B' runs on the
stream backward was called from, made to wait for the streams the gradients were
accumulated on (torch's GraphTask::exec_post_processing).

Does not know the schedule's plan of actions (it sees what ran), nor comm time inside a
stage (TP/FSDP collectives show up as CommRecords in the same interval), nor (CUDA) work
the interval queued on other streams than the current one (its marks see only that stream).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from ...records import PipelineEvent
from .clock import Clock, HostClock

_ACTIVE: list["Events"] = []


class Events:
    """The compute intervals of one step on this rank, timed by `clock` (the host's unless given)."""

    def __init__(self, rank: int, step: int, clock: Clock | None = None):
        self.rank, self.step = rank, step
        self.clock = clock if clock is not None else HostClock()
        self.events: list[PipelineEvent] = []
        self.micro = 0
        self._marks: list[tuple[int, int, str, Any, Any]] = []

    def mark(self) -> Any:
        return self.clock.mark()

    def add(self, stage: int, microbatch: int, action: str, start: Any, end: Any) -> None:
        """An interval between two marks of `mark()`; `events` holds it once the step closes."""
        self._marks.append((int(stage), int(microbatch), action, start, end))

    def close(self) -> list[PipelineEvent]:
        """Resolve the marks to host time, in the order the intervals were added."""
        clock = self.clock
        if self._marks:
            clock.settle()
        for stage, mb, action, start, end in self._marks:
            self.events.append(PipelineEvent(rank=self.rank, step=self.step, stage=stage, microbatch=mb,
                                             action=action, start=clock.resolve(start), end=clock.resolve(end)))
        self._marks.clear()
        return self.events


def _wrap_stage_method(stage, name: str, action_of) -> None:
    orig = getattr(stage, name, None)
    if orig is None:
        return

    @functools.wraps(orig)
    def timed(*args, **kwargs):
        rec = _ACTIVE[-1] if _ACTIVE else None
        if rec is None:
            return orig(*args, **kwargs)
        t0 = rec.mark()
        out = orig(*args, **kwargs)
        chunk = args[0] if args else next(iter(kwargs.values()), 0)
        rec.add(stage.stage_index, chunk, action_of(kwargs), t0, rec.mark())
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
    starts: list = []

    def pre(_mod, _args):
        if _ACTIVE:
            starts.append(_ACTIVE[-1].mark())

    def post(_mod, _args, out):
        rec = _ACTIVE[-1] if _ACTIVE else None
        if rec is None or not starts:
            return
        mb, t0 = rec.micro, starts.pop()
        rec.micro += 1
        rec.add(0, mb, "F", t0, rec.mark())
        logits = _logits(out)
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            def on_grad(grad):
                b0 = rec.mark()
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: rec.add(0, mb, "B", b0, rec.mark()))
                return grad

            logits.register_hook(on_grad)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
    module._ip_timed = True


class recording:
    """`with recording(rank, step, clock) as events:` ... `events.events` after the block."""

    def __init__(self, rank: int, step: int, clock: Clock | None = None):
        self.events = Events(rank, step, clock)

    def __enter__(self) -> Events:
        _ACTIVE.append(self.events)
        return self.events

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self.events)
        self.events.close()
