"""One start-up for a rank process that is not an ipyparallel engine: torchrun or spawned.

Owns reading who this process is (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, as torchrun sets them; arguments win over the environment, so a
test harness that spawns its own processes passes them instead) and joining the process
group through the same two calls an engine makes (runtime.groups.dist.set_identity, then
runtime.groups.dist.init: threads, sub-group timeout, backend, device). The exported script,
bench/ and the test harness all start here. Knows nothing of plans, models or ipyparallel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import dist as _dist


@dataclass(frozen=True)
class Launch:
    """Who this process is in the group, and where rank 0 listens."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, *, rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
                 local_world_size: int | None = None, master_addr: str | None = None,
                 master_port: int | None = None) -> "Launch":
        """torchrun's variables, each overridden by its argument when given.

        Without LOCAL_* (a single host) the local rank is the rank and the host holds the world.
        """
        env = os.environ
        rank = int(env["RANK"]) if rank is None else rank
        world_size = int(env["WORLD_SIZE"]) if world_size is None else world_size
        local_rank = int(env.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
        if local_world_size is None:
            local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        master_addr = env.get("MASTER_ADDR", "127.0.0.1") if master_addr is None else master_addr
        master_port = int(env["MASTER_PORT"]) if master_port is None else master_port
        return cls(rank, world_size, local_rank, local_world_size, master_addr, master_port)

    def start(self, device: str = "cpu", timeout_s: float = 120.0, *, threads: int | None = None) -> torch.device:
        """Set identity and threads, join the default group (every collective, sub-groups too,
        times out after `timeout_s`); returns the torch device this rank computes on."""
        _dist.set_identity(self.rank, self.world_size, self.local_rank, self.local_world_size, threads)
        _dist.init(self.master_addr, self.master_port, device, timeout_s)
        return _dist.torch_device(device, self.local_rank)


def init_from_env(device: str = "cpu", timeout_s: float = 120.0, *, threads: int | None = None,
                  **overrides) -> tuple[Launch, torch.device]:
    """Launch.from_env(**overrides).start(device, timeout_s): the whole start-up in one call."""
    launch = Launch.from_env(**overrides)
    return launch, launch.start(device, timeout_s, threads=threads)


def finish() -> None:
    """Leave the group once every rank is done: a rank destroying its groups while a peer
    still has gloo traffic in flight can abort in C++ ("terminate called ...").

    Garbage is collected before the groups go: a reference cycle still holding a tensor or a
    gloo work would otherwise be freed during interpreter finalization, where releasing it
    from a C++ thread aborts the process."""
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    gc.collect()
    _dist.teardown()
