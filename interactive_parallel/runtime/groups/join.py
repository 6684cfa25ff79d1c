"""A rank's part in forming its process group, step by step as the client drives it.

Owns the facts a rank reports before any group exists (identify: host, pid, cores, GPUs, the
rank a launcher gave it; network: its addresses), its identity in the group (setup), rank 0's
rendezvous socket, bound before the store takes it (master_endpoint, release_endpoint), joining
(init_process_group) and leaving (teardown), forgetting the model while staying in the group
(forget), the debug level of the groups made next
(set_debug) and the wall clock the client measures offsets against. Each is one of
runtime.api's entry points, named there with the rest, so the client asks a rank through one
module. Knows nothing of models or layouts, nor of how the client orders the steps
(cluster/rendezvous.py). Imports torch only inside functions.
"""
from __future__ import annotations

import os
import socket

from ...records import GroupMember, NetworkFacts, RankFacts, RankIdentity
from ..rank import state as _state
from ..rank.cores import usable_cores


def identify() -> RankFacts:
    """Facts the client needs to assign ranks, before any torch.distributed exists."""
    from ..rank import warm

    warm.wait()  # the first call: later ones find the imports done
    import torch

    cores = usable_cores()
    return RankFacts(host=socket.gethostname(), pid=os.getpid(), cores=cores,
                     cuda=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                     cuda_bad_fork=torch.cuda._is_in_bad_fork(), torch=_installed("torch"),
                     launcher_rank=_launcher_rank())


# Where each launcher writes a process's rank: Slurm's srun, Open MPI, MPICH / PMIx.
LAUNCHER_RANK_VARS = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def _launcher_rank() -> int:
    for name in LAUNCHER_RANK_VARS:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return -1


def _installed(dist: str) -> str:
    """The installed distribution's version, as pip records it (a host's own install)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def setup(rank: int, world_size: int, local_rank: int, local_world_size: int,
          threads: int | None = None, gpu: int = -1) -> RankIdentity:
    from . import dist as _dist

    return _dist.set_identity(rank, world_size, local_rank, local_world_size, threads, gpu)


def network(interface: str) -> NetworkFacts:
    """This rank's address on `interface` ("" when it has none) and the interfaces it does have:
    the client checks every rank before any of them waits for a rendezvous."""
    from . import net

    table = net.ipv4_interfaces()
    addrs = table.get(interface) or []
    return NetworkFacts(host=socket.gethostname(), address=addrs[0] if addrs else "",
                        interfaces=sorted(n for n, a in table.items() if a))


def master_endpoint(interface: str | None = None, toward: str | None = None) -> tuple[str, int]:
    """Rank 0's rendezvous (address, port): on `interface` when named, else on the interface
    this host reaches `toward` (the controller) through, else loopback. The store's socket is
    bound and listening from here on (no other process can take the port before the store
    does); init_process_group hands it to the store."""
    from . import net

    release_endpoint()
    sock = _state.get().store_listener = net.listener(net.rendezvous_address(interface, toward))
    return sock.getsockname()[0], sock.getsockname()[1]


def init_process_group(addr: str, port: int, device: str, timeout_s: float,
                       interface: str | None = None, recorder_entries: int | None = None) -> GroupMember:
    """Join the group at addr:port: this rank's backend, device and the sockets it binds to.
    `recorder_entries`: torch's flight recorder's size (None: runtime/probes/recorder.py's default)."""
    from . import dist as _dist

    st = _state.get()
    listen, st.store_listener = st.store_listener, None
    kw = {} if recorder_entries is None else {"recorder_entries": int(recorder_entries)}
    return _dist.init(addr, port, device, timeout_s, interface=interface, listen=listen, **kw)


def wall_clock() -> float:
    """This host's time.time(), which every record's times are in (the client corrects them)."""
    import time

    return time.time()


def teardown() -> bool:
    from . import dist as _dist

    release_endpoint()
    _dist.teardown()
    return True


def forget() -> bool:
    """Start over in the same group: the model, optimizer, plan, step, kept shards and quantized
    weights go (runtime.rank.state.reset keeps the rank's identity, this keeps its group's facts),
    armed faults are disarmed, the per-step probes and their causes are on again and the flight
    recorder's earlier entries are left out, as on a fresh engine. The process group itself stays (Session.reset)."""
    from ..probes import recorder, set_enabled, set_tracing
    from ..rank import faults

    old = _state.get()
    group = {k: getattr(old, k) for k in ("device", "backend", "interface", "address", "timeout_s")}
    st = _state.reset()
    for name, value in group.items():
        setattr(st, name, value)
    faults.disarm()
    faults.layout_built()
    set_enabled(True)
    set_tracing(True)
    recorder.start_over()  # collectives() and its dumps: nothing of the session before
    return True


def release_endpoint() -> None:
    """Close the store socket master_endpoint opened, if no store took it."""
    st = _state.get()
    sock, st.store_listener = st.store_listener, None
    if sock is not None:
        sock.close()


def set_debug(flag: bool) -> bool:
    """Before a fresh process group: TORCH_DISTRIBUTED_DEBUG=DETAIL (or OFF) for the groups made
    next. The caller keeps the state with keep_local first and re-applies with
    restore=RestoreSource.KEPT."""
    import torch.distributed as tdist

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL" if flag else "OFF"
    tdist.set_debug_level_from_env()
    return flag
