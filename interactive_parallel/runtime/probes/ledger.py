"""A step's comm ledger: what each collective or point-to-point op this rank issued is recorded as.

Owns the CommRecords of one step and their conventions, given each op as probes/comms.py sees
it (its kind, its bound arguments, its process group, the Work it returned):
- `bytes`: the full (unsharded) buffer of the op on this rank, as nccl-tests size it:
  all_reduce / broadcast: the tensor; all_gather: the gathered output (not the shard);
  reduce_scatter: the input (not the shard); all_to_all: the input; send / recv: the
  tensor. Coalesced ops count the sum of their tensors. barrier: 0.
- `group`: global ranks of the group; `axis`: the mesh axes along which the group's
  members differ from this rank (e.g. 'dp', 'dp_cp'), 'world' for the default group when
  no single axis spans it; `peer`: the global rank of the other end of a send/recv.
- `seq`: the group's collective sequence number as torch counts it on this rank (its flight
  recorder's `collective_seq_id`: the ledger and `Session.collectives()` join on it); 0 for
  send / recv and for a group that does not say.
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

Also owns `labelled(axis)`: ops issued inside are recorded on that axis. Knows nothing of how
ops are seen (the dispatcher kernels of probes/comms.py) nor of how marks become times beyond
asking the step's clock (probes/clock.py).
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

# Which argument holds the full-size buffer (see the module docstring).
FULL_ARG = {"all_gather": "output", "reduce_scatter": "input", "all_to_all": "input"}

_LABEL = threading.local()


def tensors_of(x: Any) -> list[torch.Tensor]:
    """The tensors in an op's argument (a tensor, or lists of them, nested)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in tensors_of(item)]
    return []


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


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
        self.tracer = None  # fills each record's cause (probes/causes.py), when the step is traced

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
            ts = tensors_of(bound.get("tensors", bound.get("tensor")))
        elif kind in FULL_ARG:
            key = FULL_ARG[kind]
            picked = [v for k, v in bound.items() if k.startswith(key)]
            ts = tensors_of(picked[0]) if picked else []
            if not ts:  # functional ops: only the input exists at issue; scale it
                ts = tensors_of(bound.get("input", bound.get("inputs")))
                if kind == "all_gather":
                    rec = self._add(kind, _nbytes(ts) * len(ranks), ts, ranks, is_default, None)
                    if pg is not None:  # joined with the flight recorder by it, as every other collective
                        rec.seq = _next_seq(pg)
                    return rec
        else:
            ts = tensors_of(bound.get("tensors", bound.get("input", bound.get("inputs"))))
        peer = None
        if kind in ("send", "recv"):
            local = bound.get("dst", bound.get("src"))
            if local is not None and pg is not None:
                peer = dist.get_global_rank(pg, int(local)) if pg is not dist.group.WORLD else int(local)
        rec = self._add(kind, 0 if kind == "barrier" else _nbytes(ts), ts, ranks, is_default, peer)
        if pg is not None and kind not in ("send", "recv"):
            rec.seq = _next_seq(pg)
        return rec

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


def _next_seq(pg) -> int:
    """The number the group's next collective gets (torch counts a group's collectives on each
    rank: its flight recorder's `collective_seq_id`, runtime/probes/recorder.py); 0 when the
    group does not say."""
    try:
        return int(pg._get_sequence_number_for_group()) + 1
    except Exception:  # noqa: BLE001 - another Python wrapper of the group, or a backend without it
        return 0


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
