"""Comm ledger: every collective and point-to-point op this rank issues, as CommRecords.

Owns how ops are seen and counted. Each `c10d::*` op (ProcessGroup calls: DDP's bucket
all-reduce from its C++ Reducer, FSDP2, pipeline send/recv, plain torch.distributed) and
each `_c10d_functional::*` op (DTensor / TP) is given a Python kernel at the Autograd
dispatch keys (AutogradCPU, AutogradCUDA; the functional ops, which carry autograd formulas of
their own, one key lower, at ADInplaceOrView) that notes the op and redispatches to the real
one. Why there and not a TorchDispatchMode: a mode sees every aten op of the step in
Python (a step then runs several times slower), these kernels run only for communication.
Why not monkeypatching torch.distributed: FSDP2 and DTensor call lower layers directly.
DDP's Reducer calls `c10d::allreduce_` through the dispatcher too, so its buckets are
seen here as they are: one all_reduce per bucket, its bytes the bucket's (the sum over a
step's buckets is the gradient bytes); no comm hook is needed.

Conventions of a record:
- `bytes`: the full (unsharded) buffer of the op on this rank, as nccl-tests size it:
  all_reduce / broadcast: the tensor; all_gather: the gathered output (not the shard);
  reduce_scatter: the input (not the shard); all_to_all: the input; send / recv: the
  tensor. Coalesced ops count the sum of their tensors. barrier: 0.
- `group`: global ranks of the group; `axis`: the mesh axes along which the group's
  members differ from this rank (e.g. 'dp', 'dp_cp'), 'world' for the default group when
  no single axis spans it; `peer`: the global rank of the other end of a send/recv.
- `start` / `end`: host time (time.time), read through the step's clock (probes/clock.py).
  CPU: `start` when the op was issued, `end` the first moment it was seen finished (its
  future completed, its Work was waited on, a blocking call or wait_tensor returned).
  CUDA: the host only queues an NCCL op (its future completes at enqueue), so both are marks
  on the device: `start` when the issuing stream reached the op (its inputs were ready),
  `end` the earliest of the marks after it: one recorded in the future's callback (torch runs
  it on a stream made to wait for the op's completion event), after Work.wait or
  wait_tensor (the current stream then waits for the op, and for compute queued before the
  wait), right after a blocking op (NCCL runs it on the current stream). The ops of a batch
  (batch_isend_irecv: NCCL launches them together at its end) end with the batch's Work.
  Ops never seen to finish end at the step's end mark (an upper bound where the step
  waited for them).

Device check: inside `expect_device(device)` (every probed step is) a tensor handed to a
collective or p2p op on another device type raises, naming the op and both devices. An
NCCL group rejects a CPU tensor, but gloo takes tensors of any device, so on the CPU
path this is what catches a tensor built without the group's device; tests run code with
the default device switched to meta to make such tensors show (the kernels are also
registered for meta tensors, which reach the dispatcher under AutogradMeta).

Does not know: ops on inference-mode tensors (they skip the Autograd keys), wire bytes of
an algorithm (ring vs tree), time spent on the wire versus waiting for a peer, or (CUDA)
when an op's kernel started: an NCCL stream busy with an earlier op starts it later than
`start`. NCCL's own kernel duration (Work._get_duration) is not read: it needs
TORCH_NCCL_ENABLE_TIMING set for the whole process and gives a length, not a place in time.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
import torch.distributed as dist

from ...plan import MESH_ORDER, expert_groups, mesh_coords
from ...records import CommRecord
from .clock import Clock, HostClock

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
# Which argument holds the full-size buffer (see the module docstring).
FULL_ARG = {"all_gather": "output", "reduce_scatter": "input", "all_to_all": "input"}
KEYS = ("AutogradCPU", "AutogradCUDA", "AutogradMeta")
# The functional ops have autograd formulas of their own (torch.library.register_autograd at the
# Autograd key): a kernel at AutogradCPU would hide them, and a collective's output would leave
# the graph (transformers' expert all-to-all did). Their kernels sit one key lower, where the
# autograd formula has already run.
FUNCTIONAL_KEYS = ("ADInplaceOrView",)

_LOCK = threading.Lock()
_ACTIVE: list["Ledger"] = []
_LIBS: list = []
_ORIG_WAIT: list = []
_ORIG_COALESCING: list = []
_BEFORE: list = []
_NESTED = threading.local()
_LABEL = threading.local()
_EXPECTED: list[torch.device] = []


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _bind(op, args, kwargs) -> dict[str, Any]:
    names = [a.name for a in op._schema.arguments]
    out = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}
    out.update(zip(names, args))
    out.update(kwargs)
    return out


class Ledger:
    """The records of one step on this rank; `plan` names the mesh axes, `clock` times the ops
    (the host clock unless given: probes.step gives the step's)."""

    def __init__(self, rank: int, step: int, plan=None, clock: Clock | None = None):
        self.rank, self.step, self.plan = rank, step, plan
        self.clock = clock if clock is not None else HostClock()
        self.records: list[CommRecord] = []
        self._marks: dict[int, tuple[Any, list]] = {}  # id(record) -> (start mark, end marks)
        self._works: dict[int, tuple[Any, list[CommRecord]]] = {}
        self._functional: dict[int, CommRecord] = {}
        self._coalescing: list[int] = []  # where each open batch's records begin
        self._axes: dict[tuple[int, ...], str] = {}
        self._closed = False

    # -- naming ---------------------------------------------------------------------------
    def axis_of(self, ranks: tuple[int, ...], is_default: bool) -> str:
        if ranks in self._axes:
            return self._axes[ranks]
        name = "world"
        if self.plan is not None and len(ranks) > 1:
            shape = self.plan.mesh_shape
            mine = mesh_coords(self.rank, shape)
            differ = {a for r in ranks for a, c in mesh_coords(r, shape).items() if c != mine[a]}
            axes = [a.value for a in MESH_ORDER if a in differ]
            spans_all = len(ranks) == self.plan.world_size and len(axes) > 1
            if axes and not (is_default and spans_all):
                name = "_".join(axes)
        self._axes[ranks] = name
        return name

    def expert_axis(self, kind: str, ranks: tuple[int, ...]) -> str | None:
        """'ep' for an all-to-all over this rank's ep group, else None (expert parallelism rides on
        the data-parallel ranks, so an ep group may be the dp group too: the op tells them apart)."""
        if kind != "all_to_all" or self.plan is None or getattr(self.plan, "ep", 1) <= 1:
            return None
        if not hasattr(self, "_ep_groups"):
            self._ep_groups = {tuple(g) for g in expert_groups(self.plan.mesh_shape, self.plan.ep)[0]}
        return "ep" if ranks in self._ep_groups else None

    def _group(self, pg) -> tuple[tuple[int, ...], bool]:
        try:
            ranks = tuple(dist.get_process_group_ranks(pg))
        except Exception:  # noqa: BLE001 - another Python wrapper of the same group: find it by name
            from torch.distributed.distributed_c10d import _resolve_process_group

            try:
                pg = _resolve_process_group(pg.group_name)
                ranks = tuple(dist.get_process_group_ranks(pg))
            except Exception:  # noqa: BLE001
                ranks = tuple(range(pg.size()))
        return ranks, pg is dist.group.WORLD or ranks == tuple(range(dist.get_world_size()))

    # -- recording ------------------------------------------------------------------------
    def note(self, name: str, kind: str, bound: dict[str, Any], pg) -> CommRecord:
        ranks, is_default = self._group(pg) if pg is not None else ((self.rank,), False)
        if kind in ("send", "recv"):
            ts = _tensors(bound.get("tensors", bound.get("tensor")))
        elif kind in FULL_ARG:
            key = FULL_ARG[kind]
            picked = [v for k, v in bound.items() if k.startswith(key)]
            ts = _tensors(picked[0]) if picked else []
            if not ts:  # functional ops: only the input exists at issue; scale it
                ts = _tensors(bound.get("input", bound.get("inputs")))
                if kind == "all_gather":
                    return self._add(kind, _nbytes(ts) * len(ranks), ts, ranks, is_default, None)
        else:
            ts = _tensors(bound.get("tensors", bound.get("input", bound.get("inputs"))))
        peer = None
        if kind in ("send", "recv"):
            local = bound.get("dst", bound.get("src"))
            if local is not None and pg is not None:
                peer = dist.get_global_rank(pg, int(local)) if pg is not dist.group.WORLD else int(local)
        return self._add(kind, 0 if kind == "barrier" else _nbytes(ts), ts, ranks, is_default, peer)

    def _add(self, kind, nbytes, ts, ranks, is_default, peer) -> CommRecord:
        rec = CommRecord(rank=self.rank, step=self.step, op=kind, bytes=int(nbytes),
                         dtype=str(ts[0].dtype).replace("torch.", "") if ts else "",
                         axis=getattr(_LABEL, "axis", None) or self.expert_axis(kind, ranks)
                         or self.axis_of(ranks, is_default), group=list(ranks), peer=peer)
        self._marks[id(rec)] = (self.clock.mark(), [])
        self.records.append(rec)
        return rec

    def issued(self, rec: CommRecord, work_obj, blocking: bool) -> None:
        """`rec`'s op returned `work_obj`; a blocking op has finished by now."""
        if self._coalescing:
            # NCCL launches a batch's ops together at its end: their own futures (where there
            # are any) would complete before the launch. The batch's Work ends them (end_batch).
            return
        self.watch(work_obj, rec)
        if blocking:
            self.finish(rec)

    def watch(self, work_obj, rec: CommRecord) -> None:
        try:
            work = dist.Work.unbox(work_obj)
        except Exception:  # noqa: BLE001
            return
        self._works[id(work)] = (work, [rec])
        try:
            work.get_future().add_done_callback(lambda _f: self.finish(rec))
        except Exception:  # noqa: BLE001 - a backend whose Work has no future
            pass

    def begin_batch(self) -> None:
        """The ops noted from here until end_batch are launched together (NCCL coalescing)."""
        self._coalescing.append(len(self.records))

    def end_batch(self, work) -> None:
        """The batch's ops end when its Work is seen waited (its future is not read: a
        coalesced NCCL Work need not have one)."""
        if not self._coalescing:
            return
        recs = self.records[self._coalescing.pop():]
        if recs and work is not None:
            self._works[id(work)] = (work, recs)

    def waited(self, work) -> None:
        hit = self._works.get(id(work))
        if hit is not None and hit[0] is work:
            mark = self.clock.mark()
            for rec in hit[1]:
                self.finish(rec, mark)

    def finish(self, rec: CommRecord, mark: Any = None) -> None:
        """A mark at or after the op's end (see the module docstring); the earliest one counts."""
        entry = self._marks.get(id(rec))
        if entry is not None and not self._closed:
            entry[1].append(mark if mark is not None else self.clock.mark())

    def close(self) -> list[CommRecord]:
        """Resolve every mark to host time: the records hold plain floats from here on."""
        if self._closed:
            return self.records
        self._closed = True
        clock = self.clock
        stop = clock.mark()
        clock.settle()
        stop_s = clock.resolve(stop)
        for rec in self.records:
            start, ends = self._marks.pop(id(rec))
            rec.start = clock.resolve(start)
            rec.end = min((clock.resolve(m) for m in list(ends)), default=stop_s)
        self._works.clear()
        self._functional.clear()
        self._coalescing.clear()
        return self.records


def _kernel(op, short: str, functional: bool):
    kind = KINDS.get(short, short)
    after = torch._C._after_ADInplaceOrView_keyset if functional else torch._C._after_autograd_keyset

    def kernel(keyset, *args, **kwargs):
        nested = getattr(_NESTED, "depth", 0)
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
        bound = _bind(op, args, kwargs)
        if functional:
            from torch.distributed.distributed_c10d import _resolve_process_group

            pg = _resolve_process_group(bound["group_name"])
        else:
            pg = dist.ProcessGroup.unbox(bound["process_group"])
        rec = ledger.note(short, kind, bound, pg)
        _NESTED.depth = 1
        try:
            out = op.redispatch(keyset & after, *args, **kwargs)
        finally:
            _NESTED.depth = 0
        if functional:
            for t in _tensors(out):
                ledger._functional[_pending_id(t)] = rec
        else:
            work = out[-1] if isinstance(out, tuple) else out
            ledger.issued(rec, work, blocking=bound.get("async_op") is False)
        return out

    return kernel


@contextlib.contextmanager
def labelled(axis: str):
    """Ops issued inside are recorded on `axis`: for a group that serves a purpose of its own
    beside its mesh axis (the expert replicas' gradient sum may run over the tp group)."""
    before = getattr(_LABEL, "axis", None)
    _LABEL.axis = axis
    try:
        yield
    finally:
        _LABEL.axis = before


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
    want = _EXPECTED[-1]
    for t in _tensors(list(args) + list(kwargs.values())):
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
                    for key in (FUNCTIONAL_KEYS if functional else KEYS):
                        lib.impl(short, _kernel(op, short, functional), key, with_keyset=True)
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
    """`with recording(rank, step, plan, clock) as ledger:` ... `ledger.records` after the block
    (their times resolved when it ends)."""

    def __init__(self, rank: int, step: int, plan=None, clock: Clock | None = None):
        self.ledger = Ledger(rank, step, plan, clock)

    def __enter__(self) -> Ledger:
        install()
        _ACTIVE.append(self.ledger)
        return self.ledger

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self.ledger)
        self.ledger.close()
