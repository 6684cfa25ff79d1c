"""The telemetry store: every record the ranks sent back, and the views a Session answers from it.

Owns keeping records: `history` holds every step's StepRecords (their numbers), the last
TELEMETRY_STEPS steps keep what the probes measured with them (memory, comms, compute
intervals; older steps drop those, which would otherwise grow without bound), and the
layout of the applied plan once fetched. Answers memory(), comms(), timeline() and the
loss history with no remote call, so views refresh while the ranks are training. Knows
nothing of how records are measured (runtime/probes), how they travel, or of models.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from ..records import CommRecord, MemoryRecord, PipelineEvent, RecordList, ShardRecord, StepRecord

TELEMETRY_STEPS = 20
STEP_COLUMNS = ("rank", "step", "loss", "tokens", "time_s", "plan")
MEMORY_COLUMNS = ("rank", "step", "params", "grads", "optimizer", "activations", "rss")
COMM_COLUMNS = ("rank", "step", "op", "bytes", "dtype", "axis", "group", "peer", "start", "end")
SHARD_COLUMNS = ("param", "rank", "stage", "coords", "placements", "global_shape", "local_shape", "index")


@dataclass
class Telemetry:
    """Records of this session's ranks; see the module docstring for what is kept how long."""

    history: RecordList = field(default_factory=lambda: RecordList(columns=STEP_COLUMNS))
    """Every StepRecord so far (probe records only for the latest TELEMETRY_STEPS steps)."""
    recent: deque = field(default_factory=lambda: deque(maxlen=TELEMETRY_STEPS))
    """The latest steps, each the list of every rank's full StepRecord."""
    shards: RecordList | None = None
    """ShardRecords of the applied plan (None: not fetched since it was applied)."""

    def add_step(self, records: list[StepRecord]) -> None:
        """Every rank's record of one step."""
        self.recent.append(list(records))
        self.history.extend(dataclasses.replace(r, comms=[], events=[]) for r in records)

    def plan_changed(self) -> None:
        self.shards = None

    def _latest(self, steps: int | None) -> list[StepRecord]:
        return [r for batch in list(self.recent)[-(steps or 1):] for r in batch]

    def memory(self) -> RecordList:
        """Per rank, the bytes measured in the latest step."""
        return RecordList([r.memory for r in self._latest(1) if r.memory is not None], columns=MEMORY_COLUMNS)

    def comms(self, steps: int | None = None) -> RecordList:
        return RecordList([c for r in self._latest(steps) for c in r.comms], columns=COMM_COLUMNS)

    def timeline(self, steps: int | None = None) -> RecordList:
        """Comm intervals (CommRecords) and compute intervals (PipelineEvents), rank by rank."""
        out: list[CommRecord | PipelineEvent] = []
        for r in self._latest(steps):
            out += r.comms
            out += r.events
        return RecordList(out)

    def records(self) -> list:
        """Everything held, for a report: every step, the latest step's probe records, the layout."""
        out: list = list(self.history)
        latest = self._latest(1)
        out += [r.memory for r in latest if isinstance(r.memory, MemoryRecord)]
        out += [x for r in latest for x in (*r.comms, *r.events)]
        out += list(self.shards or [])
        return out

    def keep_layout(self, shards: list[ShardRecord]) -> RecordList:
        self.shards = RecordList(shards, columns=SHARD_COLUMNS)
        return self.shards
