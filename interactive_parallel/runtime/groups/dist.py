"""Rendezvous: the default process group over the ranks, with timeouts, and its teardown.

Owns backend choice (gloo on CPU, nccl on CUDA with one GPU per local rank), the store
rank 0 serves (bound to the rendezvous address only, through a socket runtime.groups.net made),
the interface gloo and NCCL bind to (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: the one the
caller names, else one set by the user, else the one toward rank 0), the timeout applied
to the world group *and* to every sub-group a DeviceMesh creates later (gloo's and NCCL's
defaults alike), torch's flight recorder on every group (its size), NCCL's error handling, what counts as a failed NCCL group (`group_failed`:
an NCCL error raised on this rank, or a group's own error state) and its teardown by abort,
and the per-rank thread count. Knows nothing of ipyparallel: the caller tells each rank its coordinates
and the master address.
"""
from __future__ import annotations

import os
import re
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from ...records import GroupMember, RankIdentity
from ..probes import recorder
from ..rank import state as _state
from ..rank.cores import usable_cores
from . import net


def free_port(host: str = "") -> int:
    """A port nothing listens on now; the TCPStore of rank 0 binds it right after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def threads_for(local_world_size: int, cores: int | None = None) -> int:
    """Intra-op threads per rank: the host's cores shared out, at least one.

    With more threads than cores the ranks' OpenMP workers spin against each other and a
    step gets many times slower (bench/bench_threads.py). So never more threads than cores.
    """
    if cores is None:
        cores = usable_cores()
    return max(1, cores // max(1, local_world_size))


def set_identity(rank: int, world_size: int, local_rank: int, local_world_size: int,
                 threads: int | None = None, gpu: int = -1) -> RankIdentity:
    """`gpu`: the CUDA device to compute on (-1: the local rank's, as torchrun means it)."""
    st = _state.get()
    st.rank, st.world_size, st.local_rank, st.local_world_size = rank, world_size, local_rank, local_world_size
    st.gpu = local_rank if gpu < 0 else gpu
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_world_size))
    torch.set_num_threads(threads or threads_for(local_world_size))
    return RankIdentity(rank=rank, host=st.host, pid=os.getpid(), threads=torch.get_num_threads())


def backend_for(device: str) -> str:
    if device == "cuda":
        return "nccl"
    if device == "cpu":
        return "gloo"
    raise ValueError(f"device {device!r} is not 'cpu' or 'cuda'")


def torch_device(device: str, gpu: int) -> torch.device:
    return torch.device("cuda", gpu) if device == "cuda" else torch.device("cpu")


# Values this module put into the environment: a later init treats them as its own, not
# as the user's choice (which it honours).
_OURS: dict[str, str] = {}
IFNAME_VARS = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def _user_env(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None or _OURS.get(name) == value else value


def _set_env(name: str, value: str) -> None:
    os.environ[name] = _OURS[name] = value


def rendezvous_store(master_addr: str, master_port: int, rank: int, world_size: int, timeout: timedelta,
                     listen: socket.socket | None = None) -> dist.Store | None:
    """The TCPStore of the rendezvous; rank 0 serves it on `listen` (or a socket bound to
    master_addr:master_port), never on every interface. None under torchrun's agent store,
    which torchrun already serves: torch's own env rendezvous then joins it."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        if listen is not None:
            listen.close()
        return None
    if rank != 0:
        return dist.TCPStore(master_addr, master_port, world_size, False, timeout)
    sock = listen or net.listener(master_addr, master_port)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store's server owns (and closes) the socket from here
    return dist.TCPStore(master_addr, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=fd)


NCCL_ERROR_HANDLING = "2"
"""TORCH_NCCL_ASYNC_ERROR_HANDLING for our groups unless the user set it: 2 aborts a timed-out
or failed NCCL communicator and raises in the rank, without torch's default of killing the
process, so a peer that was only waiting is not taken for the dead one and can keep its shards."""


def set_group_defaults(backend: str, timeout_s: float) -> timedelta:
    """Before the first group: the timeout every later group gets by default, and NCCL's error
    handling. DeviceMesh sub-groups (and `new_group` / `split_group`) are created with the
    module defaults, not the world group's timeout: gloo's default is 30 minutes and NCCL's
    its own (`default_pg_nccl_timeout`, 10 minutes), so both are set to ours."""
    import torch.distributed.distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = timeout
    if backend == "nccl" or c10d.default_pg_nccl_timeout is not None:
        c10d.default_pg_nccl_timeout = timeout
    if backend == "nccl" and _user_env("TORCH_NCCL_ASYNC_ERROR_HANDLING") is None:
        _set_env("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERROR_HANDLING)
    return timeout


def init(master_addr: str, master_port: int, device: str = "cpu", timeout_s: float = 60.0, *,
         interface: str | None = None, listen: socket.socket | None = None,
         recorder_entries: int = recorder.ENTRIES) -> GroupMember:
    """Join the default group; every later collective (sub-groups too) times out after timeout_s.

    `interface`: the network interface this rank's gloo / NCCL sockets bind to (default:
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME as the user set it, else the interface toward
    master_addr). `listen`: on rank 0, a socket already bound and listening that the store
    serves on. `recorder_entries`: collectives torch's flight recorder keeps on this rank, over
    every group made from now on (runtime/probes/recorder.py; 0: none).
    """
    st = _state.get()
    teardown()
    backend = backend_for(device)
    if device == "cuda":
        if not torch.cuda.is_available():
            if listen is not None:
                listen.close()
            raise RuntimeError(f"rank {st.rank}: device 'cuda' asked for but torch sees no GPU")
        torch.cuda.set_device(st.gpu)
    timeout = set_group_defaults(backend, timeout_s)
    var = IFNAME_VARS[backend]
    user = None if interface else _user_env(var)
    if user:  # the user's setting stands as written (NCCL also takes lists and "^excluded")
        ifname, address = user, net.route_source(master_addr)
    else:
        ifname, address = net.bind_interface(master_addr, interface)
        _set_env(var, ifname)
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    kwargs: dict = {}
    if device == "cuda":
        kwargs["device_id"] = torch_device(device, st.gpu)
    recorder.enable(recorder_entries)  # read by torch as each group is created
    store = rendezvous_store(master_addr, master_port, st.rank, st.world_size, timeout, listen)
    if store is None:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend, store=store, rank=st.rank, world_size=st.world_size, timeout=timeout,
                            **kwargs)
    quiet_telemetry_loggers()
    st.device, st.backend, st.timeout_s = device, backend, timeout_s
    st.interface, st.address = ifname, address
    return GroupMember(rank=st.rank, backend=backend, device=device, interface=ifname, address=address)


def quiet_telemetry_loggers() -> None:
    """torch.distributed sets its c10d and checkpoint telemetry loggers ('c10d-NullHandler-*')
    to DEBUG with only a NullHandler: every wrapped collective and DCP phase builds log records
    nobody receives, a noticeable share of a small snapshot's time.
    Raised to WARNING while nothing but NullHandlers listen; a handler the user adds keeps them."""
    import logging

    import torch.distributed.checkpoint.logger  # noqa: F401 - creates the checkpoint's logger

    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (name.startswith("c10d-") and isinstance(logger, logging.Logger)
                and all(isinstance(h, logging.NullHandler) for h in logger.handlers)):
            logger.setLevel(logging.WARNING)


NCCL_ERROR = re.compile(r"NCCL|Watchdog caught collective|communicator was aborted", re.I)
"""What an error raised on an NCCL rank says when it came from NCCL (its watchdog's timeout, a
remote or system error, an aborted communicator); torch raises most as DistBackendError."""
DIST_ERRORS = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
_FAILED: list[str] = []
"""NCCL errors this rank raised since its group formed (first line of each)."""


def nccl_failure(ename: str, message: str) -> bool:
    """Whether an error (its type name and text) is one of NCCL's."""
    return ename in DIST_ERRORS or bool(NCCL_ERROR.search(message))


def note_failure(exc: BaseException) -> bool:
    """An error a call raised on this rank. Under NCCL a collective runs on its own stream and
    fails later than it was issued: by the time its error reaches Python, the step may have
    gone on with what the half-done collective left in its buffers (an optimizer update on
    partial gradients). So an NCCL error spoils this rank's state for keeping (keep_local keeps
    nothing: recovery reads the snapshot) and its group is aborted, not destroyed, at teardown.
    True when it counted."""
    if _state.get().backend != "nccl" or not nccl_failure(type(exc).__name__, str(exc)):
        return False
    _FAILED.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")
    return True


def group_failed() -> str:
    """'' while this rank's NCCL groups are sound; else what failed: an NCCL error noted on this
    rank, or a group whose NCCL backend reports an error of its own (a timeout or a
    communication error its watchdog saw, also in a call that raised nothing here). Gloo's
    groups are judged by the client (cluster/diagnose.py), since a gloo failure leaves no
    half-done work behind."""
    if _FAILED:
        return _FAILED[0]
    if _state.get().backend != "nccl" or not dist.is_initialized():
        return ""
    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import ErrorType

    for pg in list(c10d._world.pg_map):
        try:
            error = pg._get_backend(torch.device("cuda")).get_error()
        except (RuntimeError, AttributeError):  # no NCCL backend in this group
            continue
        if error != ErrorType.SUCCESS:
            return f"process group {pg.group_name!r}: {error.name}"
    return ""


def teardown() -> None:
    """Leave the process group. A failed NCCL group is aborted: destroying it would wait for
    the work stuck in its communicators, which may never finish."""
    import torch.distributed.distributed_c10d as c10d

    st = _state.get()
    st.reset_model()
    if dist.is_initialized():
        if st.backend == "nccl" and group_failed():
            c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _FAILED.clear()
    if torch.cuda.is_initialized():
        # What the old layout cached stays reserved in this process otherwise (a replacement
        # on this GPU, or the next layout, would find it taken).
        torch.cuda.empty_cache()
    st.backend = st.interface = st.address = ""
