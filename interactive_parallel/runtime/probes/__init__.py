"""Probes of a training step on this rank: memory, comm ledger, compute intervals, layout.

Owns switching them on and off (on by default: together they cost a few percent of a
tiny-llama step, see bench/bench_probes.py) and the one entry point train_step uses:

    with probes.step(par, optimizer, step, rank) as p:
        ...the step...
    p.records()  # MemoryRecord, CommRecord and PipelineEvent dicts of the step

Knows nothing of the client or of how records travel; each submodule says what it
measures and what it does not know.
"""
from __future__ import annotations

import contextlib

from ...records import MemoryRecord
from . import comms, memory, pipeline
from .layout import shard_records

ENABLED = [True]

__all__ = ["ENABLED", "set_enabled", "step", "StepProbe", "shard_records"]


def set_enabled(flag: bool) -> bool:
    ENABLED[0] = bool(flag)
    return ENABLED[0]


class StepProbe:
    """What one step left behind; `records()` gives their dicts."""

    def __init__(self, par, optimizer, step: int, rank: int):
        self.par, self.optimizer, self.step_index, self.rank = par, optimizer, step, rank
        self.params = self.grads = self.opt = None
        self.ledger = self.events = self.act = None
        self.param_list = None

    def _before_update(self, *_):
        params = self.param_list or self.par.parameters()
        self.params, self.grads = memory.param_bytes(params), memory.grad_bytes(params)

    def _after_update(self, *_):
        self.opt = memory.optimizer_bytes(self.optimizer)

    def memory_record(self) -> MemoryRecord:
        params = self.param_list or self.par.parameters()
        return MemoryRecord(
            rank=self.rank, step=self.step_index,
            params=self.params if self.params is not None else memory.param_bytes(params),
            grads=self.grads if self.grads is not None else memory.grad_bytes(params),
            optimizer=self.opt if self.opt is not None else memory.optimizer_bytes(self.optimizer),
            activations=int(self.act.peak) if self.act is not None else 0, rss=memory.rss(),
            device=self.par.device.type)

    def records(self) -> list[dict]:
        if self.ledger is None:
            return []
        out = [self.memory_record().to_dict()]
        out += [r.to_dict() for r in self.ledger.records]
        out += [e.to_dict() for e in self.events.events]
        return out


@contextlib.contextmanager
def step(par, optimizer, step_index: int, rank: int):
    """Record one step (a no-op probe when disabled)."""
    probe = StepProbe(par, optimizer, step_index, rank)
    if not ENABLED[0]:
        yield probe
        return
    if par.schedule is not None:
        pipeline.instrument_schedule(par.schedule)
    else:
        pipeline.instrument_module(par.cp_model if par.cp_model is not None else par.raw)
    probe.param_list = par.parameters()  # walks every module: once per step
    handles = [optimizer.register_step_pre_hook(probe._before_update),
               optimizer.register_step_post_hook(probe._after_update)]
    if par.device.type == "cuda":
        act = memory.DevicePeak(par.device)
    else:
        act = memory.SavedTensors(exclude=[memory.local(p) for p in probe.param_list])
    try:
        with comms.recording(rank, step_index, par.plan) as ledger, \
                pipeline.recording(rank, step_index) as events, act:
            probe.ledger, probe.events, probe.act = ledger, events, act
            yield probe
    finally:
        for h in handles:
            h.remove()
