"""Gradient clipping on the total norm of the whole model's gradient, whatever the layout:
Plan.max_grad_norm (0: off), as torch's `clip_grad_norm_` and transformers' Trainer clip one
process's gradients.

Owns the norm over every shard, mesh axis and pipeline stage, and the scaling. torch's own
functions do the work (`torch.nn.utils.get_total_norm` on each mesh's gradients, DTensors
included: a sharded gradient's norm comes back Partial and `full_tensor` sums it over the mesh
dims it is split on; `clip_grads_with_norm_` scales), as torchtitan's `clip_grad_norm_` does;
what is added here is what one rank cannot see:
- gradients on different meshes (plain tensors of a replicated layout, DTensors of the tp or
  FSDP mesh) or split on different mesh dims are normed per group and their squares summed:
  torch's norm stacks per-tensor norms, which must share one mesh, and norms of one placement
  stack without a redistribute (so a group costs one all-reduce of its norms per split dim);
- the stages of a pipeline hold disjoint parameters: the squared norms are summed over the pp
  group (one all-reduce of a scalar);
- a tied embedding and LM head held as two tensors (on two stages, or split apart by FSDP) is one
  weight in the model: only its first name's copy is counted, both copies are scaled.
Under expert parallelism each rank holds other experts as plain tensors torch cannot tell apart
from replicated ones; the plan check refuses max_grad_norm with ep (plan/validate.py).
Knows nothing of optimizers or schedules; the step calls it once the gradients are complete
(after accumulation, and after unscaling under fp16).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from ...plan import MeshAxis
from ..layout.parallelized import Parallelized


def clip_grad_norm(par: Parallelized, params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Scale the gradients of `params` (this rank's, each once) so that the whole model's gradient
    norm is at most `max_norm`; the norm before clipping, the same on every rank."""
    from ..probes.causes import issuer, phase

    groups = by_mesh(params)
    with issuer("clip_grad_norm"), phase("optimizer"):  # the ledger names the norm's all-reduces
        total = total_norm(par, groups, skip=tied_copies(par))
    for group in groups.values():  # torch scales a list of tensors on one mesh at a time
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return math.nan if is_fake(total) else total.item()  # a dry run's tensors hold no values


def by_mesh(params: list[torch.nn.Parameter]) -> dict[tuple, list[torch.nn.Parameter]]:
    """The parameters that have a gradient, by the mesh of their gradient and the mesh dims it is
    split on (() for plain tensors): each group's per-tensor norms share one placement, so torch
    stacks them as they are and sums them with one all-reduce per split dim."""
    from torch.distributed.tensor import DTensor

    out: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        key = (g.device_mesh, tuple(pl.is_shard() for pl in g.placements)) if isinstance(g, DTensor) else ()
        out.setdefault(key, []).append(p)
    return out


def total_norm(par: Parallelized, groups: dict[tuple, list[torch.nn.Parameter]], skip: set[int]) -> torch.Tensor:
    """The 2-norm of the whole model's gradient (a plain scalar tensor, fp32), from this rank's
    parameters by mesh: every shard, mesh axis and stage counted once (`skip`: copies counted
    elsewhere)."""
    from torch.distributed.tensor import DTensor

    squares = torch.zeros((), dtype=torch.float32, device=par.device)
    for group in groups.values():
        grads = [p.grad for p in group if id(p) not in skip]
        if not grads:
            continue
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = squares + norm.float() ** 2
    pp = par.group(MeshAxis.PP)
    if pp is not None:
        dist.all_reduce(squares, group=pp)
    return squares.sqrt()


def tied_copies(par: Parallelized) -> set[int]:
    """ids of this rank's second copies of a tied weight: the LM head on a later pipeline stage
    than the embedding's (finish_grads summed its gradient over the two), or a head held apart
    from the embedding on one rank. The first stage's, or the first name's, copy is counted."""
    out = set()
    if par.tie_group is not None and not par.has_first:  # the embedding's stage counts the tied weight
        out.add(id(par.raw.get_submodule(par.spec.family_info.lm_head_path).weight))
    for second, first in par.aliases.items():
        try:
            copy = par.raw.get_parameter(second)
        except AttributeError:
            continue
        try:
            original = par.raw.get_parameter(first)
        except AttributeError:
            original = None
        if copy is not original:
            out.add(id(copy))
    return out
