"""RankState: the one global a rank keeps between remote calls.

Owns what a rank remembers (its coordinates, process group facts, model, optimizer,
plan, step counter) and `reset()`. Knows nothing of how it is called: ipyparallel and a
plain torchrun script both drive it through runtime.api.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
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
    parallel: Any = None      # runtime.parallelize.Parallelized (handles of the applied plan)
    step: int = 0
    extra: dict = field(default_factory=dict)

    def reset_model(self) -> None:
        self.model = self.optimizer = self.scaler = self.mesh = self.parallel = None
        self.plan = None
        self.step = 0


STATE = RankState()


def reset() -> RankState:
    """Forget everything but the rank's identity (used by tests and by Session.reset)."""
    global STATE
    keep = {k: getattr(STATE, k) for k in ("rank", "world_size", "local_rank", "local_world_size", "host")}
    STATE = RankState(**keep)
    return STATE


def get() -> RankState:
    return STATE
