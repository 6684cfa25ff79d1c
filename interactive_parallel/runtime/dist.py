"""Rendezvous: the default process group over the ranks, with timeouts, and its teardown.

Owns backend choice (gloo on CPU, nccl on CUDA with one GPU per local rank), the free
port, the timeout applied to the world group *and* to every sub-group a DeviceMesh
creates later, and the per-rank thread count. Knows nothing of ipyparallel: the caller
tells each rank its coordinates and the master address.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from . import state as _state


def free_port(host: str = "") -> int:
    """A port nothing listens on now; the TCPStore of rank 0 binds it right after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def threads_for(local_world_size: int, cores: int | None = None) -> int:
    """Intra-op threads per rank: the host's cores shared out, at least one.

    Measured on 2 cores with 4 ranks, tiny-llama dp=4 (bench/bench_threads.py): 1 thread
    per rank 102 ms a step, 2 threads per rank 1201 ms: with more threads than cores the
    ranks' OpenMP workers spin against each other. So never more threads than cores.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def set_identity(rank: int, world_size: int, local_rank: int, local_world_size: int,
                 threads: int | None = None) -> dict:
    st = _state.get()
    st.rank, st.world_size, st.local_rank, st.local_world_size = rank, world_size, local_rank, local_world_size
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_world_size))
    torch.set_num_threads(threads or threads_for(local_world_size))
    return {"rank": rank, "host": st.host, "pid": os.getpid(), "threads": torch.get_num_threads()}


def backend_for(device: str) -> str:
    if device == "cuda":
        return "nccl"
    if device == "cpu":
        return "gloo"
    raise ValueError(f"device {device!r} is not 'cpu' or 'cuda'")


def torch_device(device: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")


def init(master_addr: str, master_port: int, device: str = "cpu", timeout_s: float = 60.0) -> dict:
    """Join the default group; every later collective (sub-groups too) times out after timeout_s."""
    st = _state.get()
    teardown()
    backend = backend_for(device)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"rank {st.rank}: device 'cuda' asked for but torch sees no GPU")
        torch.cuda.set_device(st.local_rank)
    timeout = timedelta(seconds=timeout_s)
    # DeviceMesh sub-groups are created with the module default, not the world group's
    # timeout (measured: they got 30 minutes); set the default so they inherit ours.
    import torch.distributed.distributed_c10d as c10d
    c10d.default_pg_timeout = timeout
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    kwargs = {}
    if device == "cuda":
        kwargs["device_id"] = torch_device(device, st.local_rank)
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=st.rank,
                            world_size=st.world_size, timeout=timeout, **kwargs)
    st.device, st.backend, st.timeout_s = device, backend, timeout_s
    return {"rank": st.rank, "backend": backend, "device": device}


def teardown() -> None:
    st = _state.get()
    st.reset_model()
    if dist.is_initialized():
        dist.destroy_process_group()
    st.backend = ""
