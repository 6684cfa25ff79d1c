"""Records of hardware and of step time: a machine profile, what calibration measured on the
ranks, and a plan's predicted step.

Owns the profile a step-time prediction reads (compute rates per precision, the fixed cost
of an operation, memory bandwidth and size, and one link per class of connection and
collective), the raw samples a calibration takes on each rank (plan/hardware.py fits a
profile to them), and the prediction of one plan's step (its split into compute,
communication and pipeline bubble). The shipped profiles, the fit and the model are plan/'s;
the measuring is runtime/calibration/calibrate.py's. Knows nothing of torch, ipyparallel or plotly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from .base import Record

LinkClass = Literal["intra", "inter"]
"""Where the ranks of a group sit: all on one host ('intra': shared memory, NVLink) or on
several ('inter': the network between hosts)."""
SampleKind = Literal["matmul", "op", "collective", "step", "pipeline", "handoff"]


@dataclass(frozen=True)
class Link(Record):
    """The cost of one collective on one class of link: `latency_s` per call plus its bytes
    over `bandwidth` (bus bandwidth, as nccl-tests reports it: the bytes each rank moves
    through its link, so an all_reduce of B bytes over n ranks costs 2 (n-1)/n B / bandwidth)."""

    kind: ClassVar[str] = "link"
    link: LinkClass
    latency_s: float
    bandwidth: float
    """Bytes per second."""
    op: str = "*"
    """The collective it was measured for ('all_reduce', 'send', ...); '*': every collective."""
    size: int = 0
    """The group size it was measured at (0: any size)."""


@dataclass(frozen=True)
class HardwareProfile(Record):
    """What a step-time prediction needs of a machine, per device (a GPU, or a rank's share of a CPU)."""

    kind: ClassVar[str] = "hardware_profile"
    name: str
    flops: dict[str, float]
    """Precision ('fp32', 'bf16', 'fp16') -> FLOP/s a matmul of a transformer's shapes reaches."""
    peak_flops: dict[str, float]
    """Precision -> the datasheet's dense peak FLOP/s, the denominator of MFU."""
    memory_bytes: int
    """Memory per device (a GPU's, or a CPU host's divided by its ranks)."""
    memory_bandwidth: float
    """Bytes per second an elementwise operation streams (norms, activations, the optimizer)."""
    devices_per_host: int
    cores_per_host: int = 0
    """CPU cores the devices of a host share (a rank computes on one thread): the rates above were
    measured with every device busy, and an idle rank leaves its core to the others; 0 where each
    device computes alone (GPUs)."""
    core_handoff_s: float = 0.0
    """Where ranks share cores: how long a rank computes before a core another rank left idle
    speeds it (the OS scheduler's time slice); work shorter than that runs at the every-rank-busy
    rate. 0: at once."""
    links: list[Link] = field(default_factory=list)
    """One per link class at least ('*' ops, size 0); calibration adds one per (op, group size)."""
    op_overhead_s: float = 0.0
    """Fixed cost of one operation: a kernel launch, or eager dispatch on a CPU."""
    matmul_overhead_s: float = 0.0
    """Fixed cost of one matmul beyond op_overhead_s (small shapes are dominated by it)."""
    step_overhead_s: float = 0.0
    """Fixed cost of one optimizer step beyond its operations: the training loop's own work
    (the batch, the loss's reduction, zero_grad), measured on a model step; 0 on GPUs, where the
    host runs ahead of the device."""
    replica_overhead_s: float = 0.0
    """Fixed cost of one step of a plan whose gradients a replicated wrapper averages (DDP, or
    FSDP2's replicate: Plan.replicates_gradients) beyond its modelled collectives and copies: the
    wrapper's hooks and per-bucket or per-unit bookkeeping; taken from measured steps of such a
    plan (plan.calibration.anchor_step_overhead), 0 where none were measured."""
    pipeline_action_s: float = 0.0
    """Fixed cost of one action of a pipeline schedule (a microbatch's forward, backward or weight
    half on a stage) beyond its operations: the schedule's own bookkeeping, the posting and
    waiting of its point-to-point transfers; measured on a pipeline of near-empty stages. 0 on
    GPUs, where the host runs ahead of the device."""
    overlap: float = 1.0
    """Share of the communication that runs hidden behind compute where the runtime overlaps the
    two (DDP's buckets with backward, FSDP's prefetch): 1 with a separate copy engine (GPUs),
    less where the same cores compute and communicate (gloo on a CPU)."""
    source: str = ""
    """Where the figures come from (datasheets, a calibration's date and ranks)."""
    device: str = "cuda"
    """The Plan device its ranks run on ('cpu' or 'cuda')."""

    def link(self, link: LinkClass, op: str = "*", size: int = 0) -> Link:
        """The link entry for `op` on a group of `size` ranks: measured for that op at the nearest
        size, else the link class's '*' entry."""
        mine = [x for x in self.links if x.link == link] or [x for x in self.links]
        exact = [x for x in mine if x.op == op]
        pool = exact or [x for x in mine if x.op == "*"] or mine
        return min(pool, key=lambda x: (abs(x.size - size) if size and x.size else 0, x.size))


@dataclass(frozen=True)
class CalibrationSample(Record):
    """One timed measurement on one rank: every rank runs the same one at the same time."""

    kind: ClassVar[str] = "calibration_sample"
    rank: int
    what: SampleKind
    name: str
    """'mm 512x64x256 fp32', 'add 4096', 'all_reduce g4 65536'."""
    seconds: float
    """Median time of one call."""
    flops: int = 0
    bytes: int = 0
    op: str = ""
    """A collective's name."""
    size: int = 0
    """A collective's group size; a model step's decoder layers; a pipeline's stages; the ranks
    computing a handoff burst at once."""
    microbatches: int = 0
    """A pipeline step's microbatches; a handoff burst's matmuls."""
    link: LinkClass = "intra"
    precision: str = "fp32"


@dataclass
class StepPrediction(Record):
    """One plan's predicted optimizer step on a profile: the slowest rank's seconds, split."""

    kind: ClassVar[str] = "step_prediction"
    plan: str
    """Plan.describe()."""
    profile: str
    seconds: float
    """Predicted wall time of one optimizer step (the slowest rank)."""
    compute_s: float
    """Matmuls, elementwise work, the optimizer: the slowest rank's."""
    comm_s: float
    """Communication not hidden behind compute."""
    bubble_s: float
    """Pipeline idle time of the slowest rank (0 without pp)."""
    tokens_per_s: float
    """Global tokens per second."""
    mfu: float
    """Model FLOPs (6 N per token plus attention, no recomputation) per second over the ranks' peak."""
    memory_bytes: int = 0
    """Predicted peak bytes of the fullest rank (plan.estimate)."""
    fits: bool = True
    """memory_bytes within the memory per rank asked for (or the profile's)."""
    comm_by_axis: dict[str, float] = field(default_factory=dict)
    """Mesh axis -> seconds of communication before overlap, on the slowest rank."""
    rank: int = 0
    """The slowest rank."""
    plan_fields: dict = field(default_factory=dict)
    """Plan.to_dict() of the plan (to apply or dry-run a row of a search)."""
    measured_s: float | None = None
    """Median measured step time, where a live session ran it."""

    # The knobs a search chose, for its table (describe() names only the layout).
    recompute = property(lambda self: self.plan_fields.get("recompute", ""))
    grad_accum = property(lambda self: self.plan_fields.get("grad_accum", 1))
    schedule = property(lambda self: self.plan_fields.get("pp_schedule", "") if self.plan_fields.get("pp", 1) > 1 else "")
    microbatches = property(lambda self: self.plan_fields.get("microbatches", 0))
    precision = property(lambda self: self.plan_fields.get("precision", ""))
