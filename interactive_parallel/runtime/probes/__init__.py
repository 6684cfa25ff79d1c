"""Probes of a training step on this rank: memory, comm ledger (each collective with its cause),
compute intervals, layout.

Owns switching them on and off (on by default: together, the causes' tracing included, 7-25 %
of a tiny-llama step on CPU, where each Python call shows; the tracing alone 4-14 %, about
50 us per module call: bench/bench_probes.py) and the one entry point train_step uses:

    with probes.step(par, optimizer, step, rank) as p:
        ...the step...
    p.records()  # (MemoryRecord, [CommRecord], [PipelineEvent]) of the step

The comm ledger and the compute intervals share one clock per step (probes/clock.py: the
host's on CPU, the device's on CUDA), so their times line up; its marks are resolved to
host time when the step ends. Each collective's cause (module, op, placements: probes/causes.py)
is traced with the probes on, unless `set_tracing(False)` (its cost: bench/bench_probes.py).

Knows nothing of the client or of how records travel; each submodule says what it
measures and what it does not know.
"""
from __future__ import annotations

import contextlib

from ...records import CommRecord, MemoryRecord, PipelineEvent
from . import causes, clock, comms, memory, pipeline
from .layout import shard_records

ENABLED = [True]
# Byte counts walk every parameter, gradient and optimizer state, and the activation
# peak needs a Python hook per saved tensor: together the costliest probes, a visible
# share of a small model's step (bench/bench_probes.py). With the layout and shapes fixed these numbers do not
# change from step to step, so they are measured on a layout's first step (per shape)
# and every MEASURE_EVERY steps; the steps between report the last measurement. The
# comm ledger and compute intervals are recorded on every step.
MEASURE_EVERY = 10

__all__ = ["ENABLED", "set_enabled", "set_tracing", "step", "StepProbe", "shard_records"]


def set_enabled(flag: bool) -> bool:
    ENABLED[0] = bool(flag)
    return ENABLED[0]


def set_tracing(flag: bool) -> bool:
    """Whether a probed step's collectives get their causes (probes/causes.py; on by default)."""
    causes.ENABLED[0] = bool(flag)
    return causes.ENABLED[0]


class StepProbe:
    """What one step left behind; `records()` gives them."""

    def __init__(self, par, optimizer, step: int, rank: int):
        self.par, self.optimizer, self.step_index, self.rank = par, optimizer, step, rank
        self.params = self.grads = self.opt = None
        self.ledger = self.events = self.act = self.peak = None
        self.param_list = None

    def _before_update(self, *_):
        params = self.param_list or self.par.parameters()
        self.params, self.grads = memory.param_bytes(params), memory.grad_bytes(params)

    def _after_update(self, *_):
        self.opt = memory.optimizer_bytes(self.optimizer)

    def memory_record(self) -> MemoryRecord:
        measured = self._measured()
        if self.param_list is not None:  # a measuring step: count now and keep the counts
            params = self.param_list
            measured[self._key()] = (
                self.params if self.params is not None else memory.param_bytes(params),
                self.grads if self.grads is not None else memory.grad_bytes(params),
                self.opt if self.opt is not None else memory.optimizer_bytes(self.optimizer),
                int(self.act.peak) if self.act is not None else 0,
                int(self.peak.peak) if self.peak is not None else 0)
        params, grads, opt, act, device_peak = measured[self._key()]
        return MemoryRecord(rank=self.rank, step=self.step_index, params=params, grads=grads, optimizer=opt,
                            activations=act, rss=memory.rss(), device=self.par.device.type,
                            device_peak=device_peak)

    def _key(self) -> tuple:
        p = self.par.plan
        return (p.batch_size, p.seq_len, p.grad_accum, p.n_microbatches, p.precision)

    def _measured(self) -> dict:
        """Last byte counts per shape, kept on the layout they belong to."""
        return self.par.measured_bytes

    def measures(self) -> bool:
        return self.step_index % MEASURE_EVERY == 0 or self._key() not in self._measured()

    def records(self) -> tuple[MemoryRecord | None, list[CommRecord], list[PipelineEvent]]:
        """(memory, comms, compute intervals) of the step; (None, [], []) with the probes off."""
        if self.ledger is None:
            return None, [], []
        return self.memory_record(), list(self.ledger.records), list(self.events.events)


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
    handles, act, peak = [], None, None
    if probe.measures():
        probe.param_list = par.parameters()  # walks every module
        handles = [optimizer.register_step_pre_hook(probe._before_update),
                   optimizer.register_step_post_hook(probe._after_update)]
        # activations are what autograd saves for backward on every device (what plan's
        # predict_memory means by them); the allocator's peak counts every kind at once
        act = memory.SavedTensors(exclude=[memory.local(p) for p in probe.param_list])
        if par.device.type == "cuda":
            peak = memory.DevicePeak(par.device)
    clk = clock.for_device(par.device)
    try:
        with causes.tracing(par) as tracer, comms.recording(rank, step_index, par.plan, clk, tracer) as ledger, \
                comms.expect_device(par.device), \
                pipeline.recording(rank, step_index, clk) as events, \
                act if act is not None else contextlib.nullcontext(), \
                peak if peak is not None else contextlib.nullcontext():
            probe.ledger, probe.events, probe.act, probe.peak = ledger, events, act, peak
            yield probe
    finally:
        for h in handles:
            h.remove()
