"""One-process mode: every rank of a plan in this process, with real numbers, on torch's
LocalTensorMode (torch.distributed._local_tensor), as torchtitan's `local_tensor` debug mode does.

Owns laying a model out under a plan for all of its ranks at once and training it: torch's
"fake" process group joined as rank 0 of the plan's world (it only names the ranks: no
collective goes through it), `runtime.layout.parallelize` itself (the same tensor-parallel,
sequence-parallel and loss-parallel code a live rank runs) under LocalTensorMode, whose
LocalTensors hold one tensor per rank and run each collective as the arithmetic it stands for,
and `runtime.training.train.train_step` with the probes on. Nothing of the layout or the
training step is written again here.

Where it departs from a live rank, and why:
- the storage: a live rank fills its own shards from the seeded initializer
  (runtime.layout.initialize), which reads its offsets as plain ints; under LocalTensorMode a
  DTensor's offsets are one value per rank (LocalIntNode), which it cannot read. Here the
  one-process reference's weights are built once (the same seeded values, plan-independent by
  construction) and each rank's block is cut from them with torch's own
  `_compute_local_shape_and_global_offset` for that rank's coordinates (a whole copy in this
  process: the mode is for small models);
- the records: the probes run once for all ranks (the code is SPMD), so the memory record, the
  comm ledger and the shard records are rank 0's; every other rank's are rank 0's moved along
  the mesh (plan.virtual: the groups and peers of each collective; runtime.client.dryrun.move_shards:
  index ranges recomputed by torch for its coordinates), as the dry run moves a class
  representative's. Under the plans this mode accepts every rank holds tensors of the same
  shapes and issues the same collectives, so the moved records are the live ones
  (tests/test_local_mode.py checks them against spawned ranks);
- the comm ledger's eyes: LocalTensorMode runs each collective in Python above the dispatcher key
  where the comm probe's kernels sit (runtime.probes.comms), so a dispatch mode here (`_Collectives`)
  hands each one to the same Ledger.note a live rank's goes through;
- the random generators: each entry into LocalTensorMode restarts every rank's generator from this
  process's, so on leaving this process's takes rank 0's (`LocalRanks._ranks`);
- the loss: a LocalTensor holds each rank's value; they are equal under the accepted plans (every
  rank sees the whole batch) and the step's loss is read from rank 0.

What it cannot run is refused before anything is built, by plan.local (pure): the plans whose
ranks run different Python (pipeline stages, context-parallel sequence shards, data-parallel
batch slices, routed experts) or whose wrappers allocate storage LocalTensorMode cannot give
(FSDP2, DDP, replicate); bench/bench_local_mode.py records what each does on this torch.
Knows nothing of ipyparallel or the client; imported lazily (it imports torch).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...plan import ModelSpec, Plan, check
from ...plan.local import check_local
from ...plan.virtual import DryRun, Simulated
from ...records import StepRecord
from .dryrun import _forget_groups, _placements, move_shards


class LocalModeError(RuntimeError):
    """The one-process mode cannot start here (this process already has a process group)."""


class _Collectives:
    """What the comm probe (runtime.probes.comms) sees of a live rank's collectives, seen here:
    LocalTensorMode runs every collective in Python above the dispatcher key where the probe's
    kernels sit, so none reaches them. A dispatch mode entered inside LocalTensorMode notes each
    collective to the step's open ledger (comms.note_call, which records a live rank's), and
    finishes it when it returns (a local collective is done when it returns)."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        from ..probes import comms

        class Seen(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                ledger = comms._ACTIVE[-1] if comms._ACTIVE else None
                short = func._schema.name.partition("::")[2]
                kind = comms.KINDS.get(short)
                if ledger is None or kind is None or func.namespace not in ("_c10d_functional", "c10d"):
                    if _subclassed(args, kwargs):
                        # a DTensor's op: DTensor runs it, with this mode still on the stack, so the
                        # collectives its handlers issue (loss_parallel's) are seen too
                        return NotImplemented
                    return func(*args, **kwargs)
                rec, _ = comms.note_call(ledger, func, short, kind, args, kwargs,
                                         functional=func.namespace == "_c10d_functional")
                out = func(*args, **kwargs)
                ledger.finish(rec)
                return out

        return Seen()


def _subclassed(args, kwargs) -> bool:
    """Whether an op's arguments hold a tensor subclass LocalTensorMode leaves to the subclass (DTensor)."""
    from torch.distributed._local_tensor import _check_for_subclass
    from torch.utils import _pytree as pytree

    return _check_for_subclass(pytree.tree_leaves((args, kwargs)))


def _coordinate(mesh, rank: int) -> list[int]:
    """`rank`'s coordinate on `mesh` (a plain list: read with LocalTensorMode off)."""
    where = (mesh.mesh == rank).nonzero()
    return [int(i) for i in where[0]]


def _block(full: torch.Tensor, p, rank: int, perm) -> torch.Tensor:
    """Rank `rank`'s local block of parameter `p` (a DTensor) cut from the logical `full`;
    `perm` (dim, permutation): `p` is stored permuted (GPT-2's fused q|k|v under TP)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    stored = full if perm is None else full.index_select(perm[0], perm[1])
    shape, offset = _compute_local_shape_and_global_offset(
        p.shape, p.device_mesh.shape, _coordinate(p.device_mesh, rank), p.placements)
    out = stored
    for d, (o, n) in enumerate(zip(offset, shape)):
        out = out.narrow(d, int(o), int(n))
    return out.clone()


def _local_storage(par, full: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], world: int) -> None:
    """Give every parameter and buffer of the meta layout one real tensor per rank (a LocalTensor),
    in place: each rank's block of the reference weights `full` (transformers names)."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor

    done: set[int] = set()
    for name, p in par.raw.named_parameters(remove_duplicate=False):
        if id(p) in done:
            continue
        done.add(id(p))
        logical = full[par.canonical(name)]
        if isinstance(p, DTensor):
            perm = par.perms.get(name)
            local = LocalTensor({r: _block(logical, p, r, perm) for r in range(world)})
            new = DTensor(local, p._spec, requires_grad=p.requires_grad)
        else:
            new = LocalTensor({r: logical.clone() for r in range(world)})
        torch.utils.swap_tensors(p, nn.Parameter(new, requires_grad=p.requires_grad))
    for mname, module in par.raw.named_modules():
        for bname, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                value = buffers[f"{mname}.{bname}" if mname else bname]
                module._buffers[bname] = LocalTensor({r: value.clone() for r in range(world)})


def _reference_state(spec: ModelSpec, plan: Plan) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The one-process reference's weights and buffers (the seeded values every plan starts from)."""
    from ..layout.parallelize import parallelize
    from ..training.verify import reference_plan

    ref = parallelize(spec, reference_plan(plan))
    weights = {k: v.detach().clone() for k, v in ref.raw.state_dict().items()}
    buffers = {k: v.detach().clone() for k, v in ref.raw.named_buffers()}
    return weights, buffers


class LocalRanks:
    """Every rank of `plan` in this process: the layout, its optimizer and its step, for as long as
    it lives. train(steps) returns one StepRecord per rank per step; records() the last step's
    records expanded to every rank (plan.virtual.DryRun: memory(), comms(), layout(), lint(),
    explain_comms()); full_state_dict() and full_grads() the logical tensors (rank 0's view).
    close() leaves the fake group; nothing else is left running (no thread, no process)."""

    def __init__(self, spec: ModelSpec, plan: Plan, *, checked: bool = True):
        from torch.distributed._local_tensor import LocalTensorMode
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from ..layout.lint import lint
        from ..layout.parallelize import parallelize
        from ..model.families import with_facts
        from ..training.train import make_optimizer

        spec = with_facts(spec) if spec.needs_facts else spec
        check(plan, plan.world_size, spec)
        if checked:  # off only for bench/bench_local_mode.py, which records what the refused plans do
            check_local(plan, spec)
        if dist.is_initialized():
            raise LocalModeError("the one-process mode joins its own fake process group, and this process "
                                 "already has one (run it in a process that is not a rank)")
        self.spec, self.plan, self.world = spec, plan, plan.world_size
        full, buffers = _reference_state(spec, plan)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world)
        self.mode = LocalTensorMode(self.world)
        try:
            with self.mode:
                self.par = parallelize(spec, plan, device="cpu",
                                       storage=lambda par: _local_storage(par, full, buffers, self.world))
                self.optimizer = make_optimizer(self.par)
                self.findings = lint(self.par)
        except BaseException:
            self.close()
            raise
        self.step = 0
        self.last: StepRecord | None = None

    @contextlib.contextmanager
    def _ranks(self):
        """Inside LocalTensorMode. Each entry starts every rank's random generator from this
        process's (LocalTensorMode.__enter__): on leaving, this process's takes rank 0's, so the
        next entry goes on where the ranks stopped (dropout draws fresh masks each step, as on a
        live rank, not the first step's again)."""
        with self.mode:
            yield
        state = self.mode._per_rank_rng_states.get(0)
        if state is not None:
            torch.set_rng_state(state[0])

    def train(self, steps: int) -> list[StepRecord]:
        """`steps` optimizer steps of every rank: the StepRecords, rank order within each step."""
        from ..training.train import train_step

        out = []
        for _ in range(steps):
            with self._ranks(), _Collectives():
                rec = train_step(self.par, self.optimizer, self.step, rank=0, after_backward=self._unnest_grads)
            self.last = rec
            self.step += 1
            out += [rec if r == 0 else replace(rec, rank=r, comms=[], events=[]) for r in range(self.world)]
        return out

    def _unnest_grads(self) -> None:
        """Give every gradient one level of ranks. GPT-2's backward under LocalTensorMode (torch
        2.13) returns each gradient as a LocalTensor whose per-rank entries are LocalTensors again;
        AdamW's in-place moment updates then run once per inner rank (after the first step the
        moments of two steps: m = 0.19 g, v = 0.002 g^2, measured), and the clip's norm reads them
        too. Each rank keeps its own entry of its entry, which is its gradient (parity with one
        process, tests/test_local_mode.py). Llama's gradients come back flat and pass unchanged."""
        from torch.distributed._local_tensor import LocalTensor
        from torch.distributed.tensor import DTensor

        def flat(t):
            if isinstance(t, DTensor):
                inner = flat(t._local_tensor)
                return t if inner is t._local_tensor else DTensor(inner, t._spec, requires_grad=False)
            if isinstance(t, LocalTensor) and any(isinstance(v, LocalTensor) for v in t._local_tensors.values()):
                return LocalTensor({r: v._local_tensors[r] if isinstance(v, LocalTensor) else v
                                    for r, v in t._local_tensors.items()})
            return t

        with self.mode.disable():
            for p in self.par.raw.parameters():
                if p.grad is not None:
                    p.grad = flat(p.grad)

    def records(self) -> DryRun:
        """The last step's records of every rank (rank 0's, moved along the mesh), as a DryRun holds them."""
        from .. import probes

        if self.last is None:
            raise RuntimeError("no step yet: call train first")
        with self.mode.disable():
            shards = probes.shard_records(self.par, 0)
            placements = _placements(self.par)
        sim = Simulated(memory=self.last.memory, comms=self.last.comms, shards=shards, placements=placements,
                        step=replace(self.last, comms=[], events=[]), seconds=self.last.time_s,
                        findings=self.findings)
        return DryRun(spec=self.spec, plan=self.plan, classes={r: 0 for r in range(self.world)},
                      simulated={0: sim}, mover=move_shards)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights under the transformers names, plain CPU tensors (rank 0's gathered view)."""
        with self._ranks():
            got = self.par.full_state_dict()
        return {k: _plain(v) for k, v in got.items()}

    def full_grads(self, step: int | None = None) -> tuple[float, dict[str, torch.Tensor]]:
        """The loss and full gradients of the batch of `step` (default: the next), no optimizer step."""
        from ..training.verify import loss_and_grads

        with self._ranks():
            loss, grads = loss_and_grads(self.par, self.step if step is None else step)
        return loss, {k: _plain(v) for k, v in grads.items()}

    def close(self) -> None:
        _forget_groups()


def _plain(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's tensor of a LocalTensor (every rank's is the same full tensor), else `t`."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(t, LocalTensor):
        return t._local_tensors[0]
    return t


__all__ = ["LocalModeError", "LocalRanks"]
