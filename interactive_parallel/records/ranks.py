"""Records about the ranks themselves: who they are (doctor), their clocks, whether they still
match a single-process reference (verify), predicted communication, and injected faults.

Knows nothing of torch, ipyparallel or plotly (records/base.py has the dict mechanism).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from .base import Record


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
    gpu: int = -1
    """The CUDA device it computes on (-1 off CUDA)."""


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


FaultKind = Literal["kill", "hang", "raise", "skip_collective", "slow"]
"""What an injected fault does (runtime/rank/faults.py)."""
FaultPlace = Literal["step", "collective"]
"""Where it fires: at a step boundary, or inside a collective of that step."""


@dataclass
class FaultSpec(Record):
    """A fault to inject on one rank (Session.inject; see runtime/rank/faults.py for the kinds)."""

    kind: ClassVar[str] = "fault"
    rank: int
    fault: FaultKind
    at_step: int = 0
    """Which boundary of the next long call (0: before its first step or decoding step)."""
    where: FaultPlace = "step"
    """At the boundary, or inside the `collective`-th collective of that step."""
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


@dataclass
class RankFacts(Record):
    """What an engine says of itself before any process group exists (the client assigns ranks
    from these): its host, process and devices."""

    kind: ClassVar[str] = "rank_facts"
    host: str
    pid: int
    cores: int
    """CPU cores this process may run on (its affinity)."""
    cuda: int
    """CUDA devices it sees (0: none)."""
    cuda_bad_fork: bool = False
    """It was forked from a process that had initialised CUDA: its CUDA calls will fail."""
    torch: str = ""
    """The torch distribution installed where it runs (its metadata's version)."""
    launcher_rank: int = -1
    """Its rank as the launcher that started it numbers them (SLURM_PROCID under srun, the MPI
    rank under mpiexec); -1 where none does (a local pool, SSH)."""


@dataclass
class RankIdentity(Record):
    """A rank once told who it is (setup): the threads torch runs it with."""

    kind: ClassVar[str] = "rank_identity"
    rank: int
    host: str
    pid: int
    threads: int


@dataclass
class NetworkFacts(Record):
    """One rank's address on a named interface ("" when it has none) and the interfaces it has."""

    kind: ClassVar[str] = "network_facts"
    host: str
    address: str
    interfaces: list[str] = field(default_factory=list)


@dataclass
class GroupMember(Record):
    """One rank after joining the process group: its backend and the sockets it binds to."""

    kind: ClassVar[str] = "group_member"
    rank: int
    backend: str
    device: str
    interface: str
    """Network interface the process group's sockets bind to."""
    address: str
    """This rank's address on it."""


@dataclass
class HostMemory(Record):
    """What one rank's machine has free now (read before a layout is admitted)."""

    kind: ClassVar[str] = "host_memory"
    rank: int
    host: str
    available: int
    """Bytes of host memory available."""
    gpu_free: int | None = None
    """Free bytes on this rank's GPU under CUDA (None on CPU)."""


@dataclass
class RankPlace(Record):
    """Where one rank runs, as the client assigned it: its engine, host and local rank, and once
    the process group is formed the interface and address its sockets bind to."""

    kind: ClassVar[str] = "rank_place"
    rank: int
    engine_id: int
    host: str
    pid: int
    cores: int
    cuda: int
    """CUDA devices its process sees (0: none)."""
    local_rank: int
    """Its index among the ranks on its host."""
    interface: str = ""
    address: str = ""
    gpu: int = -1
    """Under CUDA, the device it computes on: pinned to its engine at its first assignment (a
    survivor of a replacement keeps it; a replacement takes a freed one). -1 off CUDA."""
    launcher_rank: int = -1
    """Its rank as its launcher numbered it (SLURM_PROCID, the MPI rank; -1: none)."""
