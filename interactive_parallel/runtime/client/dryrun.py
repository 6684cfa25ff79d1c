"""Dry run: a plan laid over a virtual mesh of any size, in this process, with the runtime's own
code and torch's fake process group: no peers, no data, no weights.

Owns simulating ranks and expanding their records to the whole mesh. One simulated rank is
torch's fake process group (FakeStore and the "fake" backend: every collective returns at
once and moves nothing) joined as that rank, `runtime.layout.parallelize` itself (the same pipeline
split, tensor, context, recomputation and FSDP code on meta tensors) told to give the rank's
parameters and buffers FakeTensor storage (shapes, dtypes, no bytes) in place of real storage
and DDP the dry run's comm hook, so DDP and the pipeline schedule come as on a live rank, and one
`runtime.training.train.train_step` under FakeTensorMode with the probes on: the memory probe, the
comm ledger and the layout probe record what a live rank records, and nothing runs; the layout
lint (runtime.layout.lint) reads the simulated rank's placements as a live rank's.

Ranks are simulated once per class (plan/virtual.py: the same pipeline coordinate and the
same shard sizes; only FSDP over a dimension it does not divide evenly makes them differ):
they hold tensors of the same shapes and issue the same collectives, so every other rank's
records are its class representative's with the rank, its groups and peers moved along the
mesh and its index ranges recomputed by torch for its own coordinates (`move_shards`)
(tests/test_dryrun.py checks the expansion against simulating every rank, and the records
against a live run of the same plan). The representatives are shared out between this process
and forked copies of it, one per usable core (runtime.client.forked): each is simulated alone,
so where it runs changes none of its records.

Where a simulated rank departs from a live one, and why:
- the fake group delivers no bytes, so the one value a pipeline stage reads from its peers
  before the first step, the vote on whether every stage knows its shapes, is answered as
  every peer answers it (yes: runtime.parallel.pp gives every stage static shapes);
- DDP's reducer reads the bucket back from its all-reduce's future, which the fake group
  leaves empty: a comm hook issues the same all-reduce of the same bucket and returns it;
- under FakeTensorMode a function whose tensor arguments are all real runs for real (token
  ids, positions, index arithmetic) when the step calls the transformers model's own forward:
  transformers reads such values to choose its path (packed sequences, whether the causal
  mask can be skipped) and must choose as it does live. Pipeline stages and context
  parallel run runtime.model.stage's StageModule, which reads none, without it;
- mixture of experts: routing is assumed uniform. Fake tensors hold no expert ids, so a live
  rank's data-dependent steps (the routing counter's bincount, AllToAllEP reading its split
  sizes back from the exchanged counts) have nothing to read: the counter is put in its
  uniform mode (runtime.parallel.ep: every expert gets an even share of the (token, slot)
  pairs, each ep peer an even share of a rank's, the remainder spread deterministically), and
  the same all-to-alls (counts, dispatch, combine, and their backward) are issued with those
  sizes. A live run's all-to-all bytes and activations differ from these by its routing's
  imbalance; parameters, gradients, optimizer state and the collectives issued do not;
- transformers' grouped_mm experts call torch's grouped_mm, whose meta kernel takes bf16
  only: inside a simulated rank they take transformers' own fallback op
  (torch.ops.transformers.grouped_mm_fallback, which has a fake kernel) instead
  (`_grouped_mm_fallback`, restored after); it keeps its offsets (an int32 per expert) out
  of autograd's saved tensors, so activations read that many bytes per MoE layer fewer;
- Plan(compile=True): the blocks are compiled as on a live rank but run their eager code
  (runtime.parallel.compile.eager_blocks): the dry run predicts memory and communication, not
  time, and compiling costs tens of seconds. Compiling changes no parameter, gradient or
  optimizer byte nor any collective; the activations inductor saves may differ from eager's
  (bench/bench_compile.py measures both).
Knows nothing of ipyparallel or the client; imported lazily (it imports torch).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...plan import ModelSpec, Plan, check, expert_coords, mesh_coords
from ...plan.virtual import DryRun, Simulated, rank_classes
from ...records import ShardRecord
from ..training.data import reuse_batches
from .forked import map_forked


class DryRunError(RuntimeError):
    """A dry run that cannot start here (this process already has a process group)."""


def move_shards(sim: Simulated, rank: int, plan: Plan) -> list[ShardRecord]:
    """A representative's ShardRecords as another rank of its class holds them: the same
    parameters and placements, the index ranges torch computes for that rank's coordinates."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    named = {a.value: c for a, c in mesh_coords(rank, plan.mesh_shape).items()}
    shown = {a: v for a, v in named.items() if getattr(plan, a) > 1}
    if plan.ep > 1:  # the experts' mesh (runtime.parallel.ep: pp, replica, ep, tp)
        named["replica"], named["ep"] = expert_coords(rank, plan.mesh_shape, plan.ep)
    out = []
    for s in sim.shards:
        if s.param not in sim.placements:
            out.append(replace(s, rank=rank, coords=shown))
            continue
        names, mesh_shape, placements = sim.placements[s.param]
        coordinate = [_flat_coordinate(name, named, plan) for name in names]
        local, offset = _compute_local_shape_and_global_offset(s.global_shape, mesh_shape, coordinate, placements)
        out.append(replace(s, rank=rank, coords=shown, local_shape=[int(n) for n in local],
                           index=[[int(o), int(o) + int(n)] for o, n in zip(offset, local)]))
    return out


def _flat_coordinate(name: str, coords: dict[str, int], plan: Plan) -> int:
    """A rank's index along a mesh dim, flattened dims ('dp_cp') included."""
    out = 0
    for axis in name.split("_"):
        out = out * (plan.expert_replicas if axis == "replica" else getattr(plan, axis)) + coords[axis]
    return out




# ---------------------------------------------------------------- simulating one rank

class _RealWhereReal(torch.overrides.TorchFunctionMode):
    """Under FakeTensorMode, run a function for real when none of its tensor arguments is fake
    (and the index factories arange and tensor): token ids, positions and masks keep their values."""

    FACTORIES = (torch.arange, torch.tensor)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        real = func in self.FACTORIES if not tensors else not any(is_fake(t) for t in tensors)
        if real:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _fake_storage(par, fake_mode) -> None:
    """Give the rank's meta parameters and buffers FakeTensor storage on the CPU, in place.

    A DTensor parameter (TP, FSDP, replicate) is swapped, object kept, with a DTensor of the
    same spec over a fake local tensor (as `to_empty` with swapping does: FSDP keeps the
    Parameters it registered and re-reads them at its first forward); a plain parameter is
    replaced by one fake Parameter under every name the model gives it, so a tied embedding
    and head stay one (torch cannot swap a meta Parameter with a fake one).
    """
    from torch.distributed.tensor import DTensor

    def fake_like(t: torch.Tensor) -> torch.Tensor:
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")

    roots = par.stages if par.stages else [par.raw]
    new: dict[int, nn.Parameter] = {}
    for root in roots:
        for p in root.parameters():
            if not p.is_meta or id(p) in new:
                continue
            if isinstance(p, DTensor):
                local = DTensor(fake_like(p._local_tensor), p._spec, requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, nn.Parameter(local, requires_grad=p.requires_grad))
            else:
                new[id(p)] = nn.Parameter(fake_like(p), requires_grad=p.requires_grad)
        for module in root.modules():
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[name] = fake_like(b)
    for module in par.raw.modules():  # every name of a replaced parameter, outside the roots too
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in new:
                module._parameters[name] = new[id(p)]


def _answer_vote(schedule) -> None:
    """Each stage's vote on static shapes comes back as its peers would send it: yes (1)."""
    from ..probes.pipeline import schedule_stages

    for stage in schedule_stages(schedule):
        send_and_recv = stage._warmup_backward_result

        def vote(received_result=None, _own=send_and_recv):
            _own(received_result)  # the p2p a live stage runs, seen by the comm ledger
            return torch.tensor([1], dtype=torch.int32)

        stage._warmup_backward_result = vote


def _ddp_hook(group, bucket):
    """DDP's comm hook on the fake group: the same all-reduce of the same bucket, handed back
    at once (the fake group's own future carries nothing for the reducer to read)."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=group)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


@contextlib.contextmanager
def _grouped_mm_fallback():
    """transformers' grouped_mm experts forward on its fallback op, for as long as this lasts:
    `transformers.integrations.moe._can_use_grouped_mm` answers no (torch's grouped_mm has no
    fp32 meta kernel; the fallback op has a fake kernel for every dtype). Restored after."""
    from transformers.integrations import moe

    before = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = before


def _placements(par) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], tuple]]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in par.raw.named_parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            out[name] = (tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape), tuple(p.placements))
    return out


def _forget_groups() -> None:
    """Leave the fake group, and drop DTensor's caches keyed by mesh shape: a mesh of the same
    shape on the next simulated rank has other groups (they would return the old ones)."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    if dist.is_initialized():
        dist.destroy_process_group()
    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    if hasattr(_redistribute, "_gen_transform_infos"):
        _redistribute._gen_transform_infos.cache_clear()


def simulate(spec: ModelSpec, plan: Plan, rank: int, steps: int = 1) -> Simulated:
    """One rank of `plan` run for `steps` training steps on the fake group; its last step's records."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .. import probes
    from ..layout.lint import lint
    from ..layout.parallelize import parallelize
    from ..parallel.compile import eager_blocks
    from ..training.train import make_optimizer, train_step

    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        par = parallelize(spec, plan, device="cpu", storage=lambda p: _fake_storage(p, fake_mode),
                          ddp_hook=_ddp_hook)
        findings = lint(par)  # placements only: as Session.check_layout reads them on a live rank
        if par.schedule is not None:
            _answer_vote(par.schedule)
        if par.routing is not None:
            par.routing.uniform = True  # fake ids: routing assumed uniform (runtime.parallel.ep)
        optimizer = make_optimizer(par)
        # Only transformers' own forward reads index values (pipeline stages and context
        # parallel run runtime.model.stage's StageModule, which does not): the mode slows
        # every op it sees, so it is left off where nothing needs it.
        reads_values = par.schedule is None and par.cp_model is None
        experts = _grouped_mm_fallback() if spec.family_info.experts is not None else contextlib.nullcontext()
        with experts, eager_blocks(plan), fake_mode, (_RealWhereReal() if reads_values else contextlib.nullcontext()):
            for step in range(steps):
                rec = train_step(par, optimizer, step, rank=rank)
        shards = probes.shard_records(par, rank)
        placements = _placements(par)
    finally:
        _forget_groups()
    memory = replace(rec.memory, rss=0, device=plan.device)
    return Simulated(memory=memory, comms=rec.comms, shards=shards, placements=placements,
                      step=replace(rec, memory=memory, comms=[], events=[]), seconds=time.perf_counter() - start,
                      findings=findings)


def dry_run(model: Any, plan: Plan, world: int | None = None, *, steps: int = 1,
            exhaustive: bool = False) -> DryRun:
    """Lay `model` (a preset, a shipped config such as 'llama-3-70b', a config file or
    directory, a config dict or object) out under `plan` over `world` virtual ranks (default:
    the plan's) and run `steps` training steps on fake tensors; the records of the last.

    Every problem with the plan is refused before any work (PlanError naming the numbers), as
    is a model that cannot be read (UnknownModelError). exhaustive=True simulates every rank
    instead of one per class (for tests: slow on large meshes).
    """
    from ..model.families import resolved

    spec = resolved(model)
    world = plan.world_size if world is None else world
    check(plan, world, spec)
    if dist.is_initialized():
        raise DryRunError("a dry run joins its own fake process group, and this process already has one "
                          "(run it in a process that is not a rank)")
    start = time.perf_counter()
    classes = {r: r for r in range(world)} if exhaustive else rank_classes(spec, plan)
    with reuse_batches():  # the representatives across this process and forks of it, one per core
        simulated = map_forked(lambda rep: simulate(spec, plan, rep, steps), sorted(set(classes.values())),
                               what="simulated rank")
    return DryRun(spec=spec, plan=plan, classes=classes, simulated=simulated, mover=move_shards,
                  seconds=time.perf_counter() - start)


__all__ = ["DryRun", "DryRunError", "dry_run", "simulate", "move_shards"]
