"""The records that cross between ranks and the client: plain dataclasses of numbers and strings.

Owns their fields and one dict mechanism for all of them: `to_dict` (nested records become
nested dicts, each tagged with its `kind`) and `from_dict` (nested records are rebuilt from
the declared field types, so a StepRecord's MemoryRecord comes back a MemoryRecord). Ranks
build records and ship the objects themselves (ipyparallel pickles them); the client keeps
them, viz/ draws them; dicts are for JSON files and reports. Knows nothing of torch,
ipyparallel or plotly.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Sequence, TypeVar

R = TypeVar("R", bound="Record")


class Record:
    """Mixin of every record: the dict round trip (unknown keys are ignored: older clients, newer ranks)."""

    kind: ClassVar[str] = "record"

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        d["kind"] = self.kind
        return d

    @classmethod
    def from_dict(cls: type[R], d: dict[str, Any]) -> R:
        nested = _nested_fields(cls)
        values = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in d:
                continue
            v = d[f.name]
            shape, rtype = nested.get(f.name, (None, None))
            if shape == "one" and isinstance(v, dict):
                v = rtype.from_dict(v)
            elif shape == "list" and isinstance(v, list):
                v = [rtype.from_dict(x) if isinstance(x, dict) else x for x in v]
            values[f.name] = v
        return cls(**values)


def _plain(v: Any) -> Any:
    if isinstance(v, Record):
        return v.to_dict()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


@functools.cache
def _nested_fields(cls: type) -> dict[str, tuple[str, type]]:
    """Field name -> ('one' | 'list', Record subclass) for the fields declared to hold records."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str, type]] = {}
    for f in dataclasses.fields(cls):
        t = hints.get(f.name)
        origin, args = typing.get_origin(t), typing.get_args(t)
        if origin in (typing.Union, types.UnionType):
            inner = [a for a in args if a is not type(None)]
            t, origin, args = inner[0], typing.get_origin(inner[0]), typing.get_args(inner[0])
        if isinstance(t, type) and issubclass(t, Record):
            out[f.name] = ("one", t)
        elif origin is list and args and isinstance(args[0], type) and issubclass(args[0], Record):
            out[f.name] = ("list", args[0])
    return out


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
    """time.time() on the rank's host (Session.comms/timeline move it onto the client's clock)."""
    end: float = 0.0


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
class StepRecord(Record):
    """One optimizer step as one rank saw it, with what the probes measured during it."""

    kind: ClassVar[str] = "step"
    rank: int
    step: int
    loss: float
    """This rank's loss (its share of the batch); NaN on pipeline ranks without the last stage."""
    tokens: int
    """Tokens this rank processed in the step (its share of the global batch)."""
    time_s: float
    """Wall time of the step on this rank, forward to optimizer update."""
    plan: str = ""
    grad_norm: float | None = None
    lr: float | None = None
    memory: MemoryRecord | None = None
    """Bytes held during the step (None with the probes off)."""
    comms: list[CommRecord] = field(default_factory=list)
    """Every collective and p2p op the step issued on this rank."""
    events: list[PipelineEvent] = field(default_factory=list)
    """Compute intervals: forward / backward per stage and microbatch."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else 0.0


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
class TokenRecord(Record):
    """New text of one prompt after one decoding step (generation streams these)."""

    kind: ClassVar[str] = "token"
    rank: int
    prompt: int
    """Index of the prompt in the call."""
    position: int
    """Decoding step (0: the first new token)."""
    text: str
    """The text this step added (may be empty: a special token, or the prompt already ended)."""
    done: bool = False
    """True once the prompt's completion is finished (end-of-sequence or max_new_tokens)."""
    time: float = 0.0


@dataclass
class DecodeStep(Record):
    """One forward of a generation or serving loop on one rank: what it produced and what it cost."""

    kind: ClassVar[str] = "decode_step"
    rank: int
    step: int
    """0: the prompts' forward (prefill); then one per scheduler step (a token for each running row)."""
    phase: str
    """'prefill', 'decode', or 'mixed' (serving: joining requests' prompts beside the running tokens)."""
    start: float
    """Host time (time.time) at the start of the step."""
    time_s: float
    tokens: int
    """New tokens the step produced on this rank (one per live row)."""
    running: int
    """Rows in the running batch during the step."""
    waiting: int = 0
    """Requests that had arrived but were not admitted yet (serving)."""
    kv_bytes: int = 0
    """Bytes of this rank's KV cache after the step (its heads under TP, its layers under PP)."""
    kv_budget: int = 0
    """Bytes of KV cache the scheduler may fill on this rank (0: no limit)."""
    comm_s: float = 0.0
    """Time in communication, from the comm ledger (0 with the probes off or on one rank)."""
    comm_bytes: int = 0
    comm_ops: int = 0
    engine: str = ""
    """'generate', or the serving engine: 'ours' or 'transformers'."""

    @property
    def compute_s(self) -> float:
        return max(self.time_s - self.comm_s, 0.0)


@dataclass
class Request(Record):
    """One request to serve: a prompt arriving at a time, with its own limits and sampling."""

    kind: ClassVar[str] = "serve_request"
    id: str
    prompt: str
    arrival: float = 0.0
    """Seconds after the serving call starts."""
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    """Stop strings: the completion ends with the first one it produces (kept in the text)."""
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0
    """Seed of this request's own sampler: its samples do not depend on what it was batched with."""


@dataclass
class RequestRecord(Record):
    """What happened to one served request; times in seconds after the serving call started."""

    kind: ClassVar[str] = "request"
    id: str
    rank: int
    """The rank that reported it (the leader of the replica that served it)."""
    prompt: str
    arrival: float
    admitted: float = -1.0
    """When its prompt entered the running batch (-1: never)."""
    first_token: float = -1.0
    finished: float = -1.0
    tokens: int = 0
    text: str = ""
    finish_reason: str = ""
    """'eos', 'length', 'stop' (a stop string), 'interrupted' or 'error: ...'."""
    engine: str = ""

    @property
    def ttft(self) -> float:
        """Time to first token, from arrival."""
        return self.first_token - self.arrival if self.first_token >= 0 else float("nan")

    @property
    def tpot(self) -> float:
        """Time per output token after the first."""
        if self.tokens < 2 or self.finished < 0:
            return float("nan")
        return (self.finished - self.first_token) / (self.tokens - 1)


@dataclass
class ServeResult(Record):
    """A serving call: every request's record and every rank's steps."""

    kind: ClassVar[str] = "serve"
    engine: str
    """'ours' (this package's scheduler over transformers' caches) or 'transformers' (its engine)."""
    reason: str
    """Why that engine ran."""
    policy: str
    """'continuous' or 'static'."""
    plan: str
    wall_s: float
    """Seconds from the serving loop's start until its last request finished (the busiest replica;
    the engine's setup and teardown are not in it)."""
    requests: list[RequestRecord] = field(default_factory=list)
    steps: list[DecodeStep] = field(default_factory=list)

    @property
    def texts(self) -> dict[str, str]:
        return {r.id: r.text for r in self.requests}

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_ttft(self) -> float:
        done = [r.ttft for r in self.requests if r.first_token >= 0]
        return sum(done) / len(done) if done else float("nan")

    @property
    def n_steps(self) -> int:
        """Scheduler steps of the busiest rank."""
        per_rank: dict[int, int] = {}
        for s in self.steps:
            per_rank[s.rank] = per_rank.get(s.rank, 0) + 1
        return max(per_rank.values(), default=0)

    def __str__(self) -> str:
        head = (f"serve ({self.engine}, {self.policy}, plan {self.plan}): {len(self.requests)} requests, "
                f"{self.tokens} tokens in {self.wall_s:.2f} s ({self.tokens_per_s:.0f} tokens/s), "
                f"{self.n_steps} steps, mean time to first token {self.mean_ttft:.3f} s")
        shown = [dataclasses.replace(r, text=repr(r.text)) for r in self.requests]  # newlines stay on one row
        return head + "\n" + table(shown, ("id", "arrival", "admitted", "first_token", "finished", "tokens",
                                            "finish_reason", "text"))

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


@dataclass
class Generation(Record):
    """One rank's part of a generate call: its prompts' completions and its decoding steps."""

    kind: ClassVar[str] = "generation"
    rank: int
    texts: dict[int, str]
    """Prompt index -> completion, for the prompts this rank's replica decoded."""
    steps: list[DecodeStep] = field(default_factory=list)
    """The steps no channel took (all of them when no driver listens)."""


@dataclass
class QuantizeRecord(Record):
    """One rank's model before and after quantization (every number measured on the rank)."""

    kind: ClassVar[str] = "quantize"
    rank: int
    scheme: str
    plan: str
    linears: int
    """Linear layers quantized on this rank."""
    params_before: int
    """Bytes of the parameters the forward uses, before."""
    params_after: int
    kept_bytes: int = 0
    """Full-precision weights kept aside, so apply / load / dequantize return to them exactly."""
    tokens_per_s_before: float = 0.0
    tokens_per_s_after: float = 0.0
    agreement: float = 0.0
    """Fraction of the probe's greedy tokens equal to the unquantized model's."""
    probe: str = ""
    """What the speed and agreement were measured on."""


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
    interface: str = ""
    """Network interface this rank's process-group sockets bind to."""
    address: str = ""
    """This rank's address on that interface."""


@dataclass
class ClockRecord(Record):
    """How far one rank's clock (time.time) is from the client's, measured by a round trip.

    Record times from that rank minus `offset_s` are on the client's clock; the measurement
    is good to about half of `rtt_s` (the round trip it came from)."""

    kind: ClassVar[str] = "clock"
    rank: int
    host: str
    offset_s: float
    """The rank's clock minus the client's, in seconds."""
    rtt_s: float
    """Round trip of the measurement, in seconds."""


@dataclass
class CommEstimate(Record):
    """Predicted traffic of one kind of op on one mesh axis, per optimizer step on one rank."""

    kind: ClassVar[str] = "comm_estimate"
    rank: int
    op: str
    axis: str
    count: int | None
    """Ops per step (None: bucketed, the count depends on the bucket size)."""
    bytes: int
    """Full-buffer bytes per step, the comm ledger's convention."""


@dataclass
class ParamDiff(Record):
    """verify()'s row for one parameter: how far its gradient is from the reference's."""

    kind: ClassVar[str] = "param_diff"
    name: str
    shape: list[int]
    max_abs_diff: float


@dataclass
class VerifyReport(Record):
    """The current plan against a single-process reference on the same weights and batch."""

    kind: ClassVar[str] = "verify"
    ok: bool
    """True when |dloss| and every parameter's max |dgrad| are within `tolerance`."""
    tolerance: dict[str, float]
    loss_ref: float
    loss_par: float
    dloss: float
    max_grad_diff: float
    params: list[ParamDiff] = field(default_factory=list)
    """Per parameter: the max |dgrad| against the reference (full tensors)."""
    plan: str = ""
    note: str = ""
    """Why a reference could not be built, when it could not (ok is then False)."""

    def worst(self, n: int = 5) -> list[ParamDiff]:
        return sorted(self.params, key=lambda p: -p.max_abs_diff)[:n]

    def __str__(self) -> str:
        if self.note:
            return f"verify {self.plan}: not run: {self.note}"
        head = (f"verify {self.plan}: {'OK' if self.ok else 'MISMATCH'}  "
                f"loss par {self.loss_par:.6f} ref {self.loss_ref:.6f} |dloss| {self.dloss:.2e} "
                f"(tol {self.tolerance.get('loss', 0):.0e}); max |dgrad| {self.max_grad_diff:.2e} "
                f"(tol {self.tolerance.get('grad', 0):.0e})")
        width = max((len(p.name) for p in self.params), default=4)
        rows = [f"  {p.name:<{width}}  {str(tuple(p.shape)):>14}  {p.max_abs_diff:.2e}" for p in self.params]
        return "\n".join([head, f"  {'parameter':<{width}}  {'shape':>14}  max |dgrad|", *rows])

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


@dataclass
class FaultSpec(Record):
    """A fault to inject on one rank (Session.inject; see runtime/faults.py for the kinds)."""

    kind: ClassVar[str] = "fault"
    rank: int
    fault: str
    """'kill', 'hang', 'raise', 'skip_collective' or 'slow'."""
    at_step: int = 0
    """Which boundary of the next long call (0: before its first step or decoding step)."""
    where: str = "step"
    """'step' (at the boundary) or 'collective' (inside the `collective`-th collective of that step)."""
    collective: int = 0
    seconds: float = 0.0
    """slow: how long to sleep; hang: how long (0: until the rank is killed)."""
    time: float = 0.0
    """When it fired (time.time() on the rank's clock; 0: armed, not fired)."""
    detail: str = ""
    """Where it fired ('at step 1 in all_reduce (collective 0)'), once it has."""

    def describe(self) -> str:
        where = self.detail or (f"at step {self.at_step}" + (
            f", collective {self.collective}" if self.where == "collective" else ""))
        return f"{self.fault} on rank {self.rank} {where}" + (f" ({self.seconds:g} s)" if self.seconds else "")


RECORD_TYPES: dict[str, type[Record]] = {
    t.kind: t for t in (StepRecord, MemoryRecord, CommRecord, ShardRecord, PipelineEvent, TokenRecord, RankInfo,
                        ClockRecord, CommEstimate, ParamDiff, VerifyReport, FaultSpec, DecodeStep, Request,
                        RequestRecord, ServeResult, Generation, QuantizeRecord)}


def from_dict(d: dict[str, Any]) -> Record:
    """Any record from its dict, by its 'kind'."""
    return RECORD_TYPES[d["kind"]].from_dict(d)


def table(records: Sequence[Record], columns: Iterable[str] | None = None) -> str:
    """A fixed-width text table, for printing records in a terminal or notebook."""
    if not records:
        return "(no records)"
    cols = list(columns or [f.name for f in dataclasses.fields(records[0])  # type: ignore[arg-type]
                            if not isinstance(getattr(records[0], f.name), (list, Record))])

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
