"""The records that cross between ranks and the client: plain dataclasses of numbers and strings.

Owns their fields and their dict form (`to_dict` / `from_dict`). Knows nothing of torch,
ipyparallel or plotly: ranks build them, viz/ draws them, the wire carries their dicts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Sequence, TypeVar

R = TypeVar("R", bound="Record")


class Record:
    """Mixin: dict round trip that ignores unknown keys (older clients, newer ranks)."""

    kind: ClassVar[str] = "record"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)  # type: ignore[call-overload]
        d["kind"] = self.kind
        return d

    @classmethod
    def from_dict(cls: type[R], d: dict[str, Any]) -> R:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class StepRecord(Record):
    """One optimizer step as one rank saw it."""

    kind: ClassVar[str] = "step"
    rank: int
    step: int
    loss: float
    tokens: int
    """Tokens this rank processed in the step (its share of the global batch)."""
    time_s: float
    """Wall time of the step on this rank, forward to optimizer update."""
    plan: str = ""
    grad_norm: float | None = None
    lr: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else 0.0


@dataclass
class MemoryRecord(Record):
    """Bytes one rank holds, measured from local shards (a DTensor counts its local part)."""

    kind: ClassVar[str] = "memory"
    rank: int
    step: int
    params: int
    grads: int
    optimizer: int
    activations: int = 0
    """Peak bytes the step added beyond parameters, gradients and optimizer state."""
    rss: int = 0
    """Process resident set size (CPU), for orientation only."""
    device: str = "cpu"


@dataclass
class CommRecord(Record):
    """One collective or point-to-point operation issued by one rank."""

    kind: ClassVar[str] = "comm"
    rank: int
    step: int
    op: str
    """all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, send, recv, barrier."""
    bytes: int
    dtype: str = ""
    axis: str = ""
    """Mesh axis of the group ('world' for the default group)."""
    group: list[int] = field(default_factory=list)
    peer: int | None = None
    """The other rank of a send/recv."""
    start: float = 0.0
    end: float = 0.0


@dataclass
class ShardRecord(Record):
    """Which part of a full parameter one rank holds."""

    kind: ClassVar[str] = "shard"
    param: str
    rank: int
    global_shape: list[int]
    local_shape: list[int]
    placements: list[str]
    """Per mesh axis: 'Replicate()', 'Shard(dim=0)', ...; empty for a plain tensor."""
    mesh_axes: list[str]
    coords: dict[str, int]
    index: list[list[int]]
    """Per tensor dim, [start, stop) of the full tensor held locally."""
    stage: int | None = None
    """Pipeline stage holding the parameter (None: no pipeline)."""


@dataclass
class PipelineEvent(Record):
    """A forward or backward of one microbatch on one stage."""

    kind: ClassVar[str] = "pipeline"
    rank: int
    step: int
    stage: int
    microbatch: int
    action: str
    """'F' (forward), 'B' (backward), 'W' (weight gradient, zero-bubble schedules)."""
    start: float
    end: float


@dataclass
class RankInfo(Record):
    """doctor()'s row for one rank."""

    kind: ClassVar[str] = "rank"
    rank: int
    engine_id: int
    host: str
    pid: int
    local_rank: int
    device: str
    backend: str
    threads: int
    torch: str
    transformers: str
    world_size: int
    barrier_ok: bool = False
    all_reduce_ok: bool = False
    all_reduce_value: float | None = None
    bandwidth_gbps: float | None = None
    """Algorithm bandwidth of a timed all_reduce, in GB/s."""
    error: str = ""


RECORD_TYPES: dict[str, type[Record]] = {
    t.kind: t for t in (StepRecord, MemoryRecord, CommRecord, ShardRecord, PipelineEvent, RankInfo)}


def from_dict(d: dict[str, Any]) -> Record:
    return RECORD_TYPES[d["kind"]].from_dict(d)


def table(records: Sequence[Record], columns: Iterable[str] | None = None) -> str:
    """A fixed-width text table, for printing records in a terminal or notebook."""
    if not records:
        return "(no records)"
    cols = list(columns or [f.name for f in dataclasses.fields(records[0])])  # type: ignore[arg-type]

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    rows = [[fmt(getattr(r, c, "")) for c in cols] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, rows)])


class RecordList(list):
    """A list of records that prints as a table (doctor(), train() results)."""

    columns: tuple[str, ...] | None = None

    def __init__(self, items: Iterable[Record] = (), columns: Iterable[str] | None = None):
        super().__init__(items)
        self.columns = tuple(columns) if columns else None

    def __str__(self) -> str:
        return table(self, self.columns)

    def _repr_pretty_(self, p, cycle):  # IPython display
        p.text(str(self))

    def to_dicts(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self]
