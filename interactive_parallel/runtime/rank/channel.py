"""The rank's channel to whoever drives it: records out as they happen, a stop request in.

Owns two hooks and the agreement on stopping. A driver installs them once per process:
`set_sink(fn, flush)` receives each record a long call produces (a step, a generated token)
the moment it exists (a sink may hold records back briefly to send several at once: `flush`
sends what it holds); `set_stop_source(fn)` answers "was I asked to stop?" for this rank.
Long loops reach it through runtime.rank.boundary's Boundary, which calls `emit(record)`, `flush()`
before the call returns (faults call it before one that may end the process), and, at each
boundary, `agree_stop()`: one tiny all_reduce (MAX) over the world group, so every rank
stops at the same boundary even when the request reached them at different times (a rank that stopped alone would leave its peers waiting
in the next step's collectives). Training casts the same vote without waiting once a step's
gradients are ready (`cast_stop_vote`) and reads it at the next boundary (`read_stop_vote`);
under DDP the vote rides in the step's last gradient bucket (`ddp_vote_hook`) and costs no
collective of its own.

Knows nothing of ipyparallel (the Session's engines install hooks that publish through it;
a torchrun script installs none: records are returned at the end, and nobody asks to stop).
"""
from __future__ import annotations

from typing import Any, Callable

_SINK: list[Callable[[Any], None] | None] = [None]
_FLUSH: list[Callable[[], None] | None] = [None]
_STOP: list[Callable[[], bool] | None] = [None]
_CARRIED: list[bool | None] = [None]  # a vote some step's own collective carried (ddp_vote_hook)
_SEEN = [False]  # the stop source's latest answer on the main thread


def set_sink(fn: Callable[[Any], None] | None, flush: Callable[[bool], None] | None = None) -> None:
    _SINK[0], _FLUSH[0] = fn, flush


def set_stop_source(fn: Callable[[], bool] | None) -> None:
    _STOP[0] = fn


def streaming() -> bool:
    return _SINK[0] is not None


def emit(record: Any) -> bool:
    """Hand `record` to the driver now; False when none listens (the caller keeps it)."""
    sink = _SINK[0]
    if sink is None:
        return False
    sink(record)
    return True


def flush(handed_over: bool = False) -> None:
    """Send whatever the sink still holds (a no-op for sinks that hold nothing). handed_over:
    also wait until the sink's own sending thread has passed it to the transport, for a record
    the process may not outlive (a fault about to kill it): one still queued here dies with it."""
    fn = _FLUSH[0]
    if fn is not None:
        fn(handed_over)


def stop_requested() -> bool:
    """This rank's own view: was it asked to stop (not yet agreed with its peers). The stop
    source answers on the thread that runs the call; asked from another (an autograd device
    thread running a communication hook) this gives the main thread's latest answer."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _SEEN[0]
    source = _STOP[0]
    _SEEN[0] = bool(source and source())
    return _SEEN[0]


def forget_carried() -> None:
    """Drop a vote a communication hook carried outside a train loop (a call starts afresh)."""
    _CARRIED[0] = None


def agree_stop(device: Any = "cpu", finished: bool | None = None) -> bool:
    """True on every rank when any rank was asked to stop (a collective over the world group),
    or, when `finished` is given, when every rank has finished its own work.

    Without a stop source nobody can ask, so without `finished` no collective is issued:
    every rank of one job is driven the same way, so they agree on skipping it too.
    """
    if _STOP[0] is None and finished is None:
        return False
    import torch
    import torch.distributed as dist

    local = stop_requested()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local or bool(finished)
    # [asked, not finished]: MAX over ranks -> anyone asked / anyone still busy
    flags = torch.tensor([1.0 if local else 0.0, 0.0 if finished or finished is None else 1.0], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    asked, busy = flags.tolist()
    return asked > 0 or (finished is not None and busy == 0)


def cast_stop_vote(device: Any = "cpu") -> Any:
    """This rank's vote on stopping, cast over the world group without waiting for it (an async
    all_reduce MAX); read it with read_stop_vote at the next boundary. A loop casts it once a
    step's gradients are ready, so the vote travels while the optimizer updates and the
    step's records go out (a blocking agreement there was a visible share of a small dp
    step, bench/bench_session.py). Built in inference mode: the comm ledger and fault
    injection see a step's own collectives only. None when nobody can ask to stop."""
    if _STOP[0] is None:
        return None
    import torch
    import torch.distributed as dist

    carried, _CARRIED[0] = _CARRIED[0], None
    if carried is not None:
        return (None, carried)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return (None, stop_requested())
    with torch.inference_mode():
        flag = torch.tensor([1.0 if stop_requested() else 0.0], device=device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
    return (work, flag)


def read_stop_vote(vote: Any) -> bool:
    """True on every rank when any rank voted to stop (waits for the vote, within the group's
    timeout)."""
    if vote is None:
        return False
    work, flag = vote
    if work is None:
        return bool(flag)
    work.wait()
    return float(flag.item()) > 0


def ddp_vote_hook(group: Any):
    """A DDP communication hook that averages gradients as DDP's own does (divide by the group
    size, all_reduce SUM) and carries the stop vote in the last bucket of each step: one more
    element on every rank, so under DDP the vote costs no collective of its own (a separate
    one was still a visible share of a small dp step). Only when the DDP group is
    the whole world (every rank votes in it); cast_stop_vote then hands on what it carried."""
    import torch
    import torch.distributed as dist

    def hook(_state, bucket):
        size = dist.get_world_size(group)
        grads = bucket.buffer()
        if bucket.is_last() and _STOP[0] is not None and size == dist.get_world_size():
            flag = grads.new_tensor([1.0 if stop_requested() else 0.0])
            both = torch.cat([grads.div(size), flag])
            fut = dist.all_reduce(both, group=group, async_op=True).get_future()

            def split(f):
                out = f.value()[0]
                _CARRIED[0] = bool(out[-1].item() > 0)
                return grads.copy_(out[:-1])

            return fut.then(split)
        grads.div_(size)
        return dist.all_reduce(grads, group=group, async_op=True).get_future().then(lambda f: f.value()[0])

    return hook
