"""The distributed environment check, rank side: who am I, can we meet, can we add.

Owns the per-rank facts and the verified collectives of doctor(). Never raises for a
collective failure: the error goes into the rank's row, because doctor() is what a user
runs when something is already broken. Knows nothing of the client.
"""
from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ...records import RankInfo
from ..rank import state as _state


def rank_info(engine_id: int = -1) -> RankInfo:
    import transformers

    st = _state.get()
    ready = dist.is_initialized()
    return RankInfo(rank=st.rank, engine_id=engine_id, host=st.host, pid=os.getpid(), local_rank=st.local_rank,
                    device=st.device, backend=dist.get_backend() if ready else "(not initialised)",
                    threads=torch.get_num_threads(),
                    # str(): torch's version is a TorchVersion, whose unpickling imports torch
                    # into the client (200 MB in a notebook kernel that never needed it)
                    torch=str(torch.__version__), transformers=str(transformers.__version__),
                    world_size=dist.get_world_size() if ready else st.world_size,
                    interface=st.interface, address=st.address, gpu=st.gpu if st.device == "cuda" else -1)


def check(engine_id: int = -1, nbytes: int = 4 << 20, repeats: int = 3) -> RankInfo:
    info = rank_info(engine_id)
    if not dist.is_initialized():
        info.error = "process group not initialised"
        return info
    st = _state.get()
    device = torch.device("cuda", st.gpu) if st.device == "cuda" else torch.device("cpu")
    try:
        if dist.get_backend() == "gloo":
            # monitored_barrier names the ranks that did not arrive, instead of just timing out.
            dist.monitored_barrier(timeout=timedelta(seconds=st.timeout_s), wait_all_ranks=True)
        else:
            dist.barrier()
        info.barrier_ok = True
        t = torch.tensor([float(st.rank + 1)], device=device)
        dist.all_reduce(t)
        w = dist.get_world_size()
        info.all_reduce_value = float(t.item())
        info.all_reduce_ok = info.all_reduce_value == w * (w + 1) / 2
        if not info.all_reduce_ok:
            info.error = f"all_reduce gave {info.all_reduce_value}, expected {w * (w + 1) / 2}"
        buf = torch.ones(nbytes // 4, device=device)
        dist.all_reduce(buf)  # warm-up: first use of a buffer size sets up transport state
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        info.bandwidth_gbps = nbytes / min(times) / 1e9
    except Exception as exc:  # noqa: BLE001 - reported in the row, see module docstring
        info.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    return info
