"""Records of training: a step and what the probes measured during it (memory, collectives,
compute intervals), where each slice of each weight lives (and which of a parameter's tensors a fetch reads), and the text a call trains on;
`latest_run` reads a plan's latest run of steps out of a history of them (the measured step
time the step-time model is set beside and anchored to).

Knows nothing of torch, ipyparallel or plotly (records/base.py has the dict mechanism).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Sequence, get_args

from .base import Record

DataKind = Literal["text", "jsonl", "datasets"]
"""How a training text is stored: one plain text file, a .jsonl with a `text` field per line,
or a directory written by datasets' `save_to_disk`."""


@dataclass(frozen=True)
class DataSource(Record):
    """The user's text a train or verify call reads, as the client checked it (the same on
    every rank: each tokenizes it with the model's tokenizer and takes its own rows)."""

    kind: ClassVar[str] = "data_source"
    path: str
    """Absolute path, read by every rank: ranks on several hosts need it on a path they all share."""
    format: DataKind = "text"


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
    """Peak bytes saved for backward during the step (parameters excluded): plan's activations."""
    rss: int = 0
    """Process resident set size (CPU), for orientation only."""
    device: str = "cpu"
    device_peak: int = 0
    """CUDA: the allocator's peak bytes during the step beyond what was live at its start (every kind at once); 0 on CPU."""


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
    module: str = ""
    """What issued it: a module's path in the model (`model.layers.3.self_attn.o_proj`; the root
    by its class), or a wrapper's unit (`fsdp unit model.layers.3`, `replicate unit ...`, `ddp
    bucket 2`, `pipeline stage 1 -> 2`, `ep dispatch layer 5`); in backward, the module whose
    gradient was being computed. Empty: outside any module, or not traced."""
    needed_by: str = ""
    """The op that needed it: the aten op DTensor was running (`aten.mm`, `aten.nll_loss_forward`),
    `redistribute` (an explicit `.redistribute()`, a TP style's), `redistribute (backward)`,
    `from_local (backward)`, a wrapper's action (`unshard`, `post_backward`, `bucket
    all-reduce`, `activations`, `gradients`), or the runtime's function (`cp.cp_attention`)."""
    placements: str = ""
    """A DTensor redistribute's placements before and after on the mesh dim it changes
    (`S(0) -> R on tp`); empty for any other collective."""
    implicit: bool | None = None
    """A redistribute's: True when DTensor's sharding propagation chose it (a placement mismatch
    at `needed_by`), False when code asked for it; None for any other collective."""
    phase: str = ""
    """forward, backward (recomputation included) or optimizer."""
    seq: int = 0
    """The group's collective sequence number as torch counts it on this rank: the flight
    recorder's for the same op (CollectiveRecord.seq, Session.collectives()); 0 for send / recv
    and when the group does not say."""


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
class ExpertRecord(Record):
    """One MoE layer's routing in one step on one rank (all its forwards: micro-batches, pipeline
    microbatches; a recomputed forward is not counted again). Counts are (token, slot) pairs: a
    token routed to top_k experts counts top_k times."""

    kind: ClassVar[str] = "experts"
    rank: int
    step: int
    layer: int
    experts: list[int]
    """Global ids of the experts this rank holds for the layer (all of them without ep)."""
    tokens: list[int]
    """Pairs each held expert processed, in `experts` order (from every ep peer's tokens)."""
    routed: list[int]
    """Pairs this rank's own tokens sent to each expert, by global id (num_experts long). Under
    tp every tp rank routes the same tokens: count the ranks with tp_rank 0."""
    sent: list[int] = field(default_factory=list)
    """Pairs sent to each ep peer, in `ep_group` order (empty without ep)."""
    received: list[int] = field(default_factory=list)
    """Pairs received from each ep peer, in `ep_group` order (empty without ep)."""
    ep_group: list[int] = field(default_factory=list)
    """Global ranks of this rank's ep group."""
    tp_rank: int = 0


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
    experts: list[ExpertRecord] = field(default_factory=list)
    """Routing per MoE layer this rank holds (empty for a dense model)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else 0.0


def latest_run(steps: Sequence[StepRecord], plan: str) -> list[tuple[int, float]]:
    """(step, the slowest rank's seconds) of each step of the latest unbroken run under `plan` (a
    Plan.describe()) among `steps` (in arrival order), in step order; later steps under other
    plans are passed over. A run ends, going back, at another plan's step or a gap in the step
    numbers: load_model restarts them, so another model's run under the same plan is not this one."""
    times: dict[int, float] = {}
    low = 0
    for r in reversed(steps):
        if r.plan != plan:
            if times:
                break
            continue
        if times and r.step not in (low, low - 1):
            break
        low = r.step
        times[low] = max(times.get(low, 0.0), r.time_s)
    return sorted(times.items())


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


TensorKind = Literal["param", "grad", "exp_avg", "exp_avg_sq", "step"]
"""Which tensor of a parameter Session.fetch reads on a rank: the weight, its gradient, or one of
the states torch's AdamW keeps per parameter (amsgrad off: runtime.training.train.make_optimizer)."""
TENSOR_KINDS: tuple[str, ...] = get_args(TensorKind)
