"""The telemetry store: every record the ranks sent back, and the views a Session answers from it.

Owns keeping records: `history` holds every step's StepRecords (their numbers, and the
routing counts of a mixture-of-experts model: small, so kept for every step), the last
TELEMETRY_STEPS steps keep what the probes measured with them (memory, comms, compute
intervals; older steps drop those, which would otherwise grow without bound), and the
layout of the applied plan once fetched, and the latest inference call's records (its
decoding steps, a serving call's requests, the last quantization). Answers memory(),
comms(), timeline(), experts() and the loss history with no remote call, so views refresh
while the ranks are training.

Times: every rank stamps its records with its own host's clock. Each step is kept as it
arrived, with the clock offsets in force then (the rank set measures them); comms() and
timeline() hand out copies moved onto the client's clock, so ranks on different hosts line
up in one timeline, and raw=True gives the times as the ranks wrote them. Inference records
(tokens, decoding steps) are moved onto the client's clock as they arrive. Knows nothing of
how records are measured (runtime/probes), how they travel, how offsets are measured, or of
models.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from ..records import (CommRecord, DecodeStep, ExpertRecord, MemoryRecord, PipelineEvent, QuantizeRecord, RecordList,
                       ServeResult, ShardRecord, StepRecord, TokenRecord)
from ..records.training import latest_run

T = TypeVar("T", CommRecord, PipelineEvent, TokenRecord, DecodeStep)

TELEMETRY_STEPS = 20
STEP_COLUMNS = ("rank", "step", "loss", "tokens", "time_s", "plan")
MEMORY_COLUMNS = ("rank", "step", "params", "grads", "optimizer", "activations", "rss")
COMM_COLUMNS = ("rank", "step", "op", "bytes", "dtype", "axis", "group", "peer", "start", "end")
EXPERT_COLUMNS = ("rank", "step", "layer", "experts", "tokens", "routed", "sent", "received", "ep_group", "tp_rank")
SHARD_COLUMNS = ("param", "rank", "stage", "coords", "placements", "global_shape", "local_shape", "index")
DECODE_COLUMNS = ("rank", "step", "phase", "time_s", "comm_s", "tokens", "running", "waiting", "kv_bytes", "engine")
QUANTIZE_COLUMNS = ("rank", "scheme", "plan", "linears", "params_before", "params_after", "kept_bytes",
                    "tokens_per_s_before", "tokens_per_s_after", "agreement")


@dataclass
class Telemetry:
    """Records of this session's ranks; see the module docstring for what is kept how long."""

    history: RecordList = field(default_factory=lambda: RecordList(columns=STEP_COLUMNS))
    """Every StepRecord so far (probe records only for the latest TELEMETRY_STEPS steps; expert
    routing counts for all)."""
    recent: deque = field(default_factory=lambda: deque(maxlen=TELEMETRY_STEPS))
    """The latest steps, each (every rank's full StepRecord as sent, the clock offsets then)."""
    shards: RecordList | None = None
    """ShardRecords of the applied plan (None: not fetched since it was applied)."""
    clock: Callable[[], dict[int, float]] = dict
    """Rank -> seconds its clock is ahead of the client's, as measured now."""
    decoding: RecordList = field(default_factory=lambda: RecordList(columns=DECODE_COLUMNS))
    """Every rank's DecodeSteps of the latest generate or serve call."""
    served: ServeResult | None = None
    """The latest serving call."""
    quantization: RecordList = field(default_factory=lambda: RecordList(columns=QUANTIZE_COLUMNS))
    """Per rank, the latest quantization (empty: the model runs in full precision)."""

    def add_step(self, records: list[StepRecord]) -> None:
        """Every rank's record of one step."""
        self.recent.append((list(records), dict(self.clock())))
        self.history.extend(dataclasses.replace(r, comms=[], events=[]) for r in records)

    def on_client_clock(self, rec: T, offsets: dict[int, float] | None = None) -> T:
        """A copy of `rec` with its times moved from its rank's clock onto the client's."""
        off = (self.clock() if offsets is None else offsets).get(rec.rank, 0.0)
        if not off:
            return rec
        if isinstance(rec, TokenRecord):
            return dataclasses.replace(rec, time=rec.time - off)
        if isinstance(rec, DecodeStep):
            return dataclasses.replace(rec, start=rec.start - off)
        return dataclasses.replace(rec, start=rec.start - off, end=rec.end - off if rec.end else rec.end)

    def plan_changed(self) -> None:
        self.shards = None

    def run_times(self, plan: str) -> list[float]:
        """The slowest rank's seconds of each step of the latest unbroken run under `plan` (a
        Plan.describe(); records.training.latest_run), its first step (warm-up) left out."""
        return [t for _, t in latest_run(self.history, plan)][1:]

    def _latest(self, steps: int | None) -> list[StepRecord]:
        return [r for batch, _ in list(self.recent)[-(steps or 1):] for r in batch]

    def _timed(self, steps: int | None, raw: bool, comms: bool, events: bool) -> list:
        out: list = []
        for batch, offsets in list(self.recent)[-(steps or 1):]:
            for r in batch:
                held = (r.comms if comms else []) + (r.events if events else [])
                out += held if raw else [self.on_client_clock(x, offsets) for x in held]
        return out

    def memory(self) -> RecordList:
        """Per rank, the bytes measured in the latest step."""
        return RecordList([r.memory for r in self._latest(1) if r.memory is not None], columns=MEMORY_COLUMNS)

    def comms(self, steps: int | None = None, *, raw: bool = False) -> RecordList:
        return RecordList(self._timed(steps, raw, comms=True, events=False), columns=COMM_COLUMNS)

    def experts(self, steps: int | None = None) -> RecordList:
        """Every rank's ExpertRecords (routing per MoE layer) of the latest `steps` steps, all by default."""
        taken: list[list[ExpertRecord]] = []
        seen, last = 0, None
        for r in reversed(self.history):  # one step's records arrive together
            if r.step != last:
                seen, last = seen + 1, r.step
            if steps is not None and seen > steps:
                break
            taken.append(r.experts)
        return RecordList([e for experts in reversed(taken) for e in experts], columns=EXPERT_COLUMNS)

    def timeline(self, steps: int | None = None, *, raw: bool = False) -> RecordList:
        """Comm intervals (CommRecords) and compute intervals (PipelineEvents), rank by rank."""
        return RecordList(self._timed(steps, raw, comms=True, events=True))

    def records(self) -> list:
        """Everything held, for a report: every step, the latest step's probe records, the layout."""
        out: list = list(self.history)
        out += [r.memory for r in self._latest(1) if isinstance(r.memory, MemoryRecord)]
        out += self._timed(1, False, comms=True, events=True)
        out += list(self.shards or [])
        out += list(self.decoding) + list(self.quantization)
        out += [self.served] if self.served is not None else []
        return out

    def keep_decoding(self, steps: list[DecodeStep]) -> None:
        self.decoding = RecordList(sorted(steps, key=lambda r: (r.step, r.rank)), columns=DECODE_COLUMNS)

    def keep_served(self, result: ServeResult) -> None:
        self.served = result
        self.keep_decoding(result.steps)

    def keep_quantization(self, records: list[QuantizeRecord]) -> None:
        self.quantization = RecordList(records, columns=QUANTIZE_COLUMNS)

    def keep_layout(self, shards: list[ShardRecord]) -> RecordList:
        self.shards = RecordList(shards, columns=SHARD_COLUMNS)
        return self.shards
