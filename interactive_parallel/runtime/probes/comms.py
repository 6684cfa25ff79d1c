"""The comm probe: every collective and point-to-point op this rank issues, seen as it is issued
and handed to the step's comm ledger (probes/ledger.py), which records it as a CommRecord.

Owns how ops are seen, and when they are seen finished. Each `c10d::*` op (ProcessGroup calls: DDP's
bucket all-reduce from its C++ Reducer, FSDP2, pipeline send/recv, plain torch.distributed) and
each `_c10d_functional::*` op (DTensor / TP, loss_parallel, funcol) is given a Python kernel at
the BackendSelect dispatch key, the last key before the backend's own kernel, that notes the op
and redispatches to the real one. Every call of an op passes there: one issued inside DTensor's
own dispatch (an implicit redistribute its sharding propagation chose, loss_parallel's
cross-entropy all-reduces, a Partial placement's reduction) runs with the Autograd and
ADInplaceOrView keys excluded (DTensor dispatches below autograd), and so did a DTensor
backward's; a kernel there saw none of them. Under FakeTensorMode (the dry run) the fake
kernel is reached through BackendSelect too. Each op is seen once: while a noted op runs (a
functional collective calls its ProcessGroup through `c10d::*`), nested ops pass through.
Ops issued under `torch.inference_mode()` pass through unseen, as they always did (the loop's
stop vote, a silent decoding step). Why not a TorchDispatchMode (torch's CommDebugMode is one):
a mode sees every aten op of the step in Python (a step then runs several times slower); these
kernels run only for communication. Why not monkeypatching torch.distributed: FSDP2 and DTensor
call lower layers directly. DDP's Reducer calls `c10d::allreduce_` through the dispatcher too,
so its buckets are seen here as they are: one all_reduce per bucket, its bytes the bucket's (the
sum over a step's buckets is the gradient bytes); no comm hook is needed. What each op is
recorded as (its bytes, group, axis, start and end) is the step's Ledger's (probes/ledger.py);
what caused it, the step's tracer's when one is on (probes/causes.py).

Device check: inside `expect_device(device)` (every probed step is) a tensor handed to a
collective or p2p op on another device type raises, naming the op and both devices. An
NCCL group rejects a CPU tensor, but gloo takes tensors of any device, so on the CPU
path this is what catches a tensor built without the group's device; tests run code with
the default device switched to meta to make such tensors show (meta tensors reach the
dispatcher's BackendSelect key as any other).

Does not know: ops issued in inference mode, wire bytes of an algorithm (ring vs tree), time
spent on the wire versus waiting for a peer, or (CUDA) when an op's kernel started: an NCCL
stream busy with an earlier op starts it later than `start`. NCCL's own kernel duration
(Work._get_duration) is not read: it needs TORCH_NCCL_ENABLE_TIMING set for the whole process
and gives a length, not a place in time.
"""
from __future__ import annotations

import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

from .clock import Clock
from .ledger import Ledger, tensors_of

KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter", "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all", "barrier": "barrier", "monitored_barrier_": "barrier",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv", "isend": "send", "irecv": "recv",
}
KEY = "BackendSelect"
# Only the backend's kernels lie below BackendSelect: a noted op is redispatched to them.
_BELOW = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)

_LOCK = threading.Lock()
_ACTIVE: list[Ledger] = []
_LIBS: list = []
_ORIG_WAIT: list = []
_ORIG_COALESCING: list = []
_BEFORE: list = []
_NESTED = threading.local()
_EXPECTED: list[torch.device] = []


def _bind(op, args, kwargs) -> dict[str, Any]:
    names = [a.name for a in op._schema.arguments]
    out = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}
    out.update(zip(names, args))
    out.update(kwargs)
    return out


def note_call(ledger: "Ledger", op, short: str, kind: str, args, kwargs, functional: bool) -> tuple[Any, dict[str, Any]]:
    """(the ledger's record, the bound arguments) of collective `op` about to run: its arguments
    bound to their names, its process group resolved (a functional collective names its group, a
    ProcessGroup call passes it boxed) and, with a tracer, what caused it, read off the caller's
    stack (probes/causes.py). Where a live rank's kernel and the one-process mode's dispatch mode
    (runtime/client/local.py) both record a call."""
    bound = _bind(op, args, kwargs)
    if functional:
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(bound["group_name"])
    else:
        pg = dist.ProcessGroup.unbox(bound["process_group"])
    rec = ledger.note(short, kind, bound, pg)
    if ledger.tracer is not None:
        p2p = tensors_of(bound.get("tensors")) if kind in ("send", "recv") else []
        ledger.tracer.annotate(rec, kind, p2p, sys._getframe(1))
    return rec, bound


def _kernel(op, short: str, functional: bool):
    kind = KINDS.get(short, short)
    after = _BELOW

    def kernel(keyset, *args, **kwargs):
        nested = getattr(_NESTED, "depth", 0)
        if not nested and torch.is_inference_mode_enabled():
            nested = 1  # not seen (the module docstring)
        if _EXPECTED and not nested and short != "wait_tensor":
            _check_device(kind, args, kwargs)
        if _BEFORE and not nested and short != "wait_tensor" and _BEFORE[0](kind):
            return _skipped(op, args)
        ledger = _ACTIVE[-1] if _ACTIVE else None
        if ledger is None or nested:
            # a functional collective runs its ProcessGroup call through c10d::*: count it once
            return op.redispatch(keyset & after, *args, **kwargs)
        if short == "wait_tensor":
            out = op.redispatch(keyset & after, *args, **kwargs)
            rec = ledger._functional.pop(_pending_id(args[0]), None) if args else None
            if rec is not None:
                ledger.finish(rec)
            return out
        rec, bound = note_call(ledger, op, short, kind, args, kwargs, functional)
        _NESTED.depth = 1
        try:
            out = op.redispatch(keyset & after, *args, **kwargs)
        finally:
            _NESTED.depth = 0
        if functional:
            for t in tensors_of(out):
                ledger._functional[_pending_id(t)] = rec
        else:
            work = out[-1] if isinstance(out, tuple) else out
            ledger.issued(rec, work, blocking=bound.get("async_op") is False)
        return out

    return kernel


def _pending_id(t: torch.Tensor) -> int:
    """The storage object under a functional collective's output: the same when wait_tensor gets
    it, and readable before the op has finished (its data pointer need not be: transformers'
    autograd all_to_all hands back such a tensor)."""
    return t.untyped_storage()._cdata


def set_before(hook) -> None:
    """`hook(op_kind) -> skip?` before every collective this process issues (runtime/rank/faults.py)."""
    install()
    _BEFORE[:] = [hook] if hook is not None else []


def _skipped(op, args):
    """What a collective returns when it is skipped: its buffers untouched and a finished Work."""
    from torch._C._distributed_c10d import FakeWork

    out = []
    for ret in op._schema.returns:
        text = str(ret.type)
        if "Work" in text:
            out.append(FakeWork().boxed())
        else:
            out.append(args[0])  # the op's first tensor argument: its output buffer (or input)
    return out[0] if len(out) == 1 else tuple(out)


def _check_device(kind: str, args, kwargs) -> None:
    if torch._C._meta_in_tls_dispatch_include():
        return  # FakeTensorMode running an op's meta kernel: its fake tensors read as meta here
    want = _EXPECTED[-1]
    for t in tensors_of(list(args) + list(kwargs.values())):
        if t.device.type != want.type:
            raise RuntimeError(f"{kind} was handed a tensor on {t.device} {tuple(t.shape)}, but the process "
                               f"group computes on {want}: build it on the group's device (an NCCL group "
                               "rejects a CPU tensor)")


def _patched_wait(self, *args, **kwargs):
    result = _ORIG_WAIT[0](self, *args, **kwargs)
    ledger = _ACTIVE[-1] if _ACTIVE else None
    if ledger is not None:
        ledger.waited(self)
    return result


def _patched_start_coalescing(self, *args, **kwargs):
    _ORIG_COALESCING[0](self, *args, **kwargs)
    ledger = _ACTIVE[-1] if _ACTIVE else None
    if ledger is not None:
        ledger.begin_batch()


def _patched_end_coalescing(self, *args, **kwargs):
    work = _ORIG_COALESCING[1](self, *args, **kwargs)
    ledger = _ACTIVE[-1] if _ACTIVE else None
    if ledger is not None:
        ledger.end_batch(work)
    return work


def install() -> None:
    """Register the kernels once per process (they pass straight through when no ledger is open)."""
    with _LOCK:
        if _LIBS:
            return
        try:
            for ns, functional in (("c10d", False), ("_c10d_functional", True)):
                lib = torch.library.Library(ns, "IMPL")
                _LIBS.append(lib)
                packet = getattr(torch.ops, ns)
                for short in list(KINDS) + (["wait_tensor"] if functional else []):
                    op = getattr(getattr(packet, short, None), "default", None)
                    if op is None:
                        continue
                    lib.impl(short, _kernel(op, short, functional), KEY, with_keyset=True)
        except BaseException:
            while _LIBS:  # half a ledger would be a wrong one: none at all
                _LIBS.pop()._destroy()
            raise
        _ORIG_WAIT.append(dist.Work.wait)
        dist.Work.wait = _patched_wait
        # batch_isend_irecv's batch on NCCL: begun and ended through these two (gloo has no batches)
        _ORIG_COALESCING.extend([dist.ProcessGroup._start_coalescing, dist.ProcessGroup._end_coalescing])
        dist.ProcessGroup._start_coalescing = _patched_start_coalescing
        dist.ProcessGroup._end_coalescing = _patched_end_coalescing


class expect_device:
    """`with expect_device(device):` a collective or p2p op handed a tensor on another device
    type raises (see the module docstring)."""

    def __init__(self, device):
        self.device = torch.device(device)

    def __enter__(self) -> "expect_device":
        install()
        _EXPECTED.append(self.device)
        return self

    def __exit__(self, *exc) -> None:
        _EXPECTED.remove(self.device)


class recording:
    """`with recording(rank, step, plan, clock, tracer) as ledger:` ... `ledger.records` after the
    block (their times resolved when it ends; their causes filled by `tracer` when given:
    probes/causes.py)."""

    def __init__(self, rank: int, step: int, plan=None, clock: Clock | None = None, tracer=None):
        self.ledger = Ledger(rank, step, plan, clock)
        self.ledger.tracer = tracer

    def __enter__(self) -> Ledger:
        install()
        _ACTIVE.append(self.ledger)
        return self.ledger

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self.ledger)
        self.ledger.close()
