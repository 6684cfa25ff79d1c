"""RankState: the one global a rank keeps between remote calls.

Owns what a rank remembers (its coordinates, process group facts, model, optimizer,
plan, step counter, and what one call leaves for a later one: a listening socket, kept
shards, a re-plan's parts, a quantized model's full-precision weights) and `reset()`.
Knows nothing of how it is called: ipyparallel and a plain torchrun script both drive it
through runtime.api. Imports no torch: the types named here are only annotations.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...plan import Plan

if TYPE_CHECKING:
    import torch


@dataclass
class KeptShards:
    """One rank's own shards of weights and optimizer state, by reference, and whose they are.

    Declared here, with the state that holds them (RankState.kept), so the state names its
    fields without knowing who fills them (runtime.checkpoints.recovery keeps and restores them)."""

    plan: Plan
    """The plan whose layout holds them: only a layout of the same plan takes them."""
    rank: int
    step: int
    parts: dict[str, torch.Tensor]
    """'model.<name>' and 'optim.<name>.<field>' -> this rank's local block."""


@dataclass
class Quantized:
    """What quantize left on a rank: the scheme, and the full-precision weights it took out of
    the linears (module path -> weight), put back by dequantize."""

    scheme: str
    full: dict[str, Any]


@dataclass
class RankState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    gpu: int = 0
    """The CUDA device this rank computes on under CUDA: the client's pinned choice (its
    local rank under torchrun)."""
    host: str = field(default_factory=socket.gethostname)
    device: str = "cpu"
    backend: str = ""
    interface: str = ""       # network interface the process group's sockets bind to
    address: str = ""         # this rank's address on it
    timeout_s: float = 60.0
    spec: Any = None          # plan.ModelSpec
    plan: Any = None          # plan.Plan (None until apply)
    model: Any = None         # the parallelized nn.Module (or pipeline stage modules)
    optimizer: Any = None
    scaler: Any = None
    mesh: Any = None          # torch DeviceMesh
    parallel: Any = None      # runtime.layout.parallelize.Parallelized (handles of the applied plan)
    step: int = 0
    store_listener: socket.socket | None = None
    """Rank 0's rendezvous socket, bound and listening since master_endpoint, until
    init_process_group hands it to the store (or release_endpoint closes it)."""
    kept: KeptShards | None = None
    """This rank's own shards, kept by keep_local across a re-formed process group, until a
    layout of the same plan takes them (apply_plan(restore=KEPT)) or any layout is built."""
    pending_state: str | None = None
    """Where the layout being replaced wrote its parts, until the new layout has read them."""
    quantized: Quantized | None = None
    """Set while the model is quantized (quantize), until dequantize puts the weights back."""

    def reset_model(self) -> None:
        self.model = self.optimizer = self.scaler = self.mesh = self.parallel = None
        self.plan = None
        self.step = 0


STATE = RankState()


def reset() -> RankState:
    """Forget everything but the rank's identity (used by tests and by Session.reset)."""
    global STATE
    keep = {k: getattr(STATE, k) for k in ("rank", "world_size", "local_rank", "local_world_size", "gpu", "host")}
    STATE = RankState(**keep)
    return STATE


def get() -> RankState:
    return STATE
