"""Forming the ranks' process group: which engine is which rank, where rank 0 opens the store
and how every rank joins it.

Owns the rank assignment (`assign`: stable, hosts contiguous, per-host local ranks, one GPU
each under CUDA, pinned to its engine across re-forms), the choice of the rendezvous address
(loopback on one host; across hosts the interface the user names, checked on every rank
first, or the one rank 0 reaches the controller through: runtime/groups/net.py picks the address on
the rank) and the refusal of an address other hosts cannot reach. Knows nothing of models, and nothing of pools beyond the call it is
handed (`call(fn, args, ranks=..., what=..., timeout=...)`, results in rank order).
"""
from __future__ import annotations

import dataclasses
from typing import Awaitable, Callable, Sequence

from ..records import GroupMember, RankPlace
from ..runtime import api
from ..runtime.groups import net
from . import engine_side
from .errors import SessionError


async def form_group(call: Callable[..., Awaitable[list]], places: Sequence[RankPlace], *, device: str,
                     collective_timeout: float, interface: str | None,
                     recorder_entries: int | None = None) -> list[GroupMember]:
    """Rank 0 opens the store on its chosen address, every rank joins; each rank's GroupMember."""
    hosts = list(dict.fromkeys(p.host for p in places))
    if interface:
        await check_interface(call, interface)
    toward = None
    if interface is None and len(hosts) > 1:
        (toward,) = await call(engine_side.controller_address, ranks=[0], what="rendezvous")
    (addr, port), = await call(api.master_endpoint, (interface, toward), ranks=[0], what="rendezvous")
    if len(hosts) > 1 and net.is_loopback(addr):
        await call(api.release_endpoint, ranks=[0], what="rendezvous")
        how = f"interface {interface!r}" if interface else f"its route to the controller at {toward}"
        raise SessionError(f"rank 0 (host {hosts[0]}) would rendezvous on loopback {addr} ({how}), which "
                           f"the ranks on {', '.join(hosts[1:])} cannot reach: name the interface the hosts "
                           "reach each other through, e.g. Session.attach(..., interface='eth0')")
    return await call(api.init_process_group, (addr, port, device, collective_timeout, interface, recorder_entries),
                      what="init_process_group", timeout=collective_timeout + 10)


async def check_interface(call: Callable[..., Awaitable[list]], interface: str) -> None:
    """Every rank has an IPv4 address on `interface`, or SessionError naming those without."""
    found = await call(api.network, (interface,), what="rendezvous")
    missing = [f"rank {r} on {f.host} (interfaces: {', '.join(f.interfaces)})"
               for r, f in enumerate(found) if not f.address]
    if missing:
        raise SessionError(f"interface {interface!r} has no IPv4 address on " + "; ".join(missing))


def _same_torch(facts: list) -> None:
    """One torch everywhere: ranks of different builds disagree on collectives' wire formats and
    on numerics, which surfaces much later as a hang or a parity failure."""
    hosts: dict[str, set[str]] = {}
    for f in facts:
        hosts.setdefault(f.torch, set()).add(f.host)
    if len(hosts) > 1:
        ranked = sorted(hosts.items(), key=lambda kv: len(kv[1]))  # the odd ones out first
        raise SessionError("torch differs across hosts: " + "; ".join(
            f"{', '.join(sorted(h))} {'has' if len(h) == 1 else 'have'} torch {v or '(not installed)'}"
            for v, h in ranked) + ": every rank must run the same torch build (install the same version on every host)")


def assign(ids: list[int], facts: list, device: str, pinned: dict[int, int] | None = None) -> list[RankPlace]:
    """Ranks in a stable order: hosts in order of their lowest engine id, engine ids within a
    host, so a host's ranks are contiguous (TP, the innermost mesh axis, stays on one host);
    under CUDA every local rank needs a GPU of its own. Where a launcher numbered every engine
    (srun's SLURM_PROCID, the MPI rank) its numbers order them instead of the engine ids,
    which follow registration: torch's ranks then follow the launcher's, host by host.

    `pinned`: engine id -> GPU from the previous assignment. A surviving engine keeps its GPU
    (its CUDA context and cached memory stay there: moving it would hold two GPUs' worth on one
    and crowd a replacement onto a device still in use); a new engine takes the lowest GPU of
    its host that no survivor holds."""
    _same_torch(facts)
    numbered = all(f.launcher_rank >= 0 for f in facts) and len({f.launcher_rank for f in facts}) == len(facts)
    key = [f.launcher_rank if numbered else e for e, f in zip(ids, facts)]
    first = sorted(range(len(ids)), key=key.__getitem__) if numbered else range(len(ids))
    hosts = list(dict.fromkeys(facts[i].host for i in first))
    order = sorted(range(len(ids)), key=lambda i: (hosts.index(facts[i].host), key[i]))
    if device == "cuda":
        short = sorted({f"{f.host} has {f.cuda} GPU(s)" for f in facts if f.cuda == 0})
        if short:
            raise SessionError("device 'cuda' asked for, but " + "; ".join(short))
        spoiled = sorted({f.host for f in facts if f.cuda_bad_fork})
        if spoiled:
            raise SessionError(f"device 'cuda' asked for, but the engines on {', '.join(spoiled)} were forked "
                               "from a process that had initialised CUDA, so their CUDA calls fail: start the "
                               "Session with launch='warm' (each engine imports torch itself)")
    local: dict[str, int] = {}
    places = []
    for rank, i in enumerate(order):
        f = facts[i]
        places.append(RankPlace(rank=rank, engine_id=ids[i], host=f.host, pid=f.pid, cores=f.cores, cuda=f.cuda,
                                local_rank=local.setdefault(f.host, 0), launcher_rank=f.launcher_rank))
        local[f.host] += 1
    if device != "cuda":
        return places
    gpus = {h: min(f.cuda for f in facts if f.host == h) for h in local}
    over = [f"{h}: {n} ranks > {gpus[h]} GPUs" for h, n in local.items() if n > gpus[h]]
    if over:
        raise SessionError("one GPU per local rank needed; " + "; ".join(over))
    return pin_gpus(places, gpus, pinned or {})


def pin_gpus(places: list[RankPlace], gpus: dict[str, int], pinned: dict[int, int]) -> list[RankPlace]:
    """Each place with its GPU: the pinned one where its engine has one (and it is still on the
    host and not taken twice), else the lowest free one on its host."""
    held: dict[str, set[int]] = {h: set() for h in gpus}
    keep: dict[int, int] = {}
    for p in places:
        gpu = pinned.get(p.engine_id, -1)
        if 0 <= gpu < gpus[p.host] and gpu not in held[p.host]:
            keep[p.engine_id] = gpu
            held[p.host].add(gpu)
    out = []
    for p in places:
        gpu = keep.get(p.engine_id)
        if gpu is None:
            gpu = min(set(range(gpus[p.host])) - held[p.host])
            held[p.host].add(gpu)
        out.append(dataclasses.replace(p, gpu=gpu))
    return out
