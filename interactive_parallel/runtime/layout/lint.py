"""The layout lint: what a laid-out model will get wrong, named per parameter and mesh axis, before a step.

Owns `lint(par)`: a static reading of the rank's own layout, nothing run. For each parameter
this rank holds it reads its DTensor placement on every mesh axis (or that it has none: a
plain tensor, whole and unsynchronised on that axis), and beside it the facts the layout was
made from: the family's TP plan and each style's record (plan.tp_styles), the fused
projections (FamilyInfo.linears with a 'qkv' output) and the permutation the rank keeps
(Parallelized.perms), the ParallelStyles runtime.parallel.tp builds from them, and the plan
(sequence parallel, the data-parallel wrapper). Where each module's input varies over tp is
read from the same facts: under sequence parallelism a block's residual stream is cut on the
sequence over tp, so every module of a block outside its attention and MLP sees only its
rank's tokens; inside an attention or MLP that holds a split-output (colwise) linear, a module
the TP plan leaves unstyled or styles as a per-head norm reads that linear's split output
(Qwen3's q_norm); nowhere else do inputs vary over tp. Over dp, fsdp and cp every rank's
input differs (its own share of the batch or sequence).

Why a static reading, and not one of the other two ways: torch's fake or local machinery
running a step (the dry run does, runtime.client.dryrun) costs a traced forward and backward
(0.4-1.8 s a plan for the parity plans' 4-layer models, measured) where this costs about a
millisecond and so runs at every `apply`; and the faults named here are facts of the placements
(a replicated weight fed sequence-split tokens, a fused split without its permutation) that a
step would show only as numbers. `spmd-types` (the per-axis type checker on the package index)
is not in the environment and is not added. The one collective a step would issue that no
module asked for, a norm's Partial gradient all-reduced by the optimizer's own ops, is
predicted here from the same placements, but only where nothing reduces it first: no data
wrapper, and the runtime's own reduction after backward turned off
(runtime.layout.parallelized.REDUCE_PARTIAL); tests/test_lint.py, test_dryrun.py and
test_any_model.py hold that prediction to the dry run's implicit redistributes (every parity
plan, every derived family's plans; with the reduction off, sequence parallelism's plans).

What it cannot see: a module's input read from the facts is a model of the block (attention
and MLP gather the sequence, a colwise linear splits its output), so a model whose forward
reads a tensor outside that shape (a norm on a value made inside an unstyled helper) is judged
by where the module sits; hooks and custom autograd that reduce a gradient by hand are seen
only as the parameter's tensor hooks; a wrong number that no placement explains (a style that
splits the right dim the wrong way) is verify()'s to find. Knows nothing of the client, of
collectives or of how findings are shown.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ...plan.tp_styles import TpStyle
from ...records.lint import LintFinding, LintKind, LintSeverity
from .parallelized import REDUCE_PARTIAL

DATA_AXES = ("dp", "fsdp", "cp")
"""Axes on which every rank's input differs (its own share of the batch or of the sequence)."""


def lint(par) -> list[LintFinding]:
    """Every finding of this rank's layout (a Parallelized: real, meta or fake tensors alike)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    held = _held(par)
    found = _data_axes(par, held) + _divisible(held)
    if par.plan.tp > 1:
        found += _tp(par, held) + _partial_outputs(par, held) + _own_embedding_forward(par, held)
    for f in found:
        f.ranks = [rank]
    return found


def _own_embedding_forward(par, held: dict) -> list[LintFinding]:
    """A vocabulary-split embedding whose module works on the looked-up rows inside its own forward
    (Gemma 3's scaled embedding), before the style's output hook all-reduces them: DTensor sums the
    rows' partial lookups there, implicitly, for the op that needs it (the same one all-reduce)."""
    from torch import nn

    name = par.spec.family_info.embedding_path
    if not par.plan.vocab_split or f"{name}.weight" not in held:
        return []
    if type(par.raw.get_submodule(name)).forward is nn.Embedding.forward:
        return []
    return [_finding(
        f"{name}.weight", "tp", LintKind.IMPLICIT_REDISTRIBUTE, LintSeverity.COST,
        "split on the vocabulary, its module's own forward works on the looked-up rows (a partial sum over tp) "
        "before the style's output all-reduce, so DTensor all-reduces them there, implicitly, every forward "
        "(the same one all-reduce, issued by the op that needs it)",
        "nothing to change; or keep the ends whole (Plan(vocab_parallel=False)), an all-reduce less and "
        "the embedding whole on every tp rank")]


def _held(par) -> dict:
    """Name -> parameter of those this rank holds and trains (under pp only its stages')."""
    roots = par.stages or [par.raw]
    mine = {id(p) for root in roots for p in root.parameters()}
    return {n: p for n, p in par.raw.named_parameters() if id(p) in mine and p.requires_grad}


def _on(p, axis: str):
    """p's placement on mesh axis `axis` (a flattened dim such as 'dp_cp' counts for each part),
    or None: a plain tensor, or a DTensor whose mesh lacks the axis (whole and unsynchronised on it)."""
    if not isinstance(p, DTensor):
        return None
    for name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements):
        if axis in name.split("_"):
            return placement
    return None


def _finding(param: str, axis: str, kind: LintKind, severity: LintSeverity, why: str, fix: str) -> LintFinding:
    return LintFinding(param=param, axis=axis, fault=kind.value, severity=severity.value, why=why, fix=fix)


def _data_axes(par, held: dict) -> list[LintFinding]:
    """A gradient no wrapper reduces over a data axis: DDP takes every parameter; otherwise FSDP2's
    fully_shard and replicate make each parameter they reduce a DTensor on that axis, and expert
    weights under ep are reduced by the layout itself (runtime.parallel.ep)."""
    plan = par.plan
    if plan.uses_ddp:
        return []
    experts = {id(p) for p in par.expert_params}
    out = []
    for axis in (a for a in DATA_AXES if getattr(plan, a) > 1):
        for name, p in held.items():
            if id(p) not in experts and _on(p, axis) is None:
                out.append(_finding(
                    name, axis, LintKind.GRAD_NOT_REDUCED, LintSeverity.WRONG,
                    f"each {axis} rank's gradient covers only its own share of the "
                    f"{'sequence' if axis == 'cp' else 'batch'}, and no DDP bucket, FSDP or replicate unit holds it",
                    f"let the data-parallel wrapper take it (not ignored by fully_shard / replicate), "
                    f"or all-reduce its gradient over {axis} after backward"))
    return out


def _divisible(held: dict) -> list[LintFinding]:
    """A Shard(d) whose mesh dim does not divide d: under tp the ranks' widths then disagree with
    the attention's bookkeeping (it divides by tp); FSDP pads the short shard (bytes moved for nothing)."""
    out = []
    for name, p in held.items():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        for i, (axis, placement) in enumerate(zip(mesh.mesh_dim_names or (), p.placements)):
            if type(placement) is not Shard:
                continue
            size, length = mesh.size(i), p.shape[placement.dim]
            if length % size:
                tp = "tp" in axis.split("_")
                out.append(_finding(
                    name, axis, LintKind.NOT_DIVISIBLE, LintSeverity.WRONG if tp else LintSeverity.COST,
                    f"dim {placement.dim} ({length}) is not divisible by {axis}({size}): the shards differ in size"
                    + ("" if tp else ", and the short ones are padded in every gather"),
                    f"choose {axis} dividing {length}" + ("" if tp else " (or accept the padding)")))
    return out


def _tp(par, held: dict) -> list[LintFinding]:
    """Per parameter of a tp layer: its gradient's reduction over tp, and a fused projection's split."""
    spec, plan = par.spec, par.plan
    fam = spec.family_info
    styles = fam.block_tp_records()
    prefix = fam.layers_path + "."
    out = []
    for name, p in held.items():
        if not name.startswith(prefix):
            continue
        _layer, _, inner = name[len(prefix):].partition(".")
        path, _, leaf = inner.rpartition(".")
        style = styles.get(path)
        linear = fam.linears.get(path)
        if linear is not None and (linear.out_width == "qkv" or (style is not None and style.packed == "qkv")):
            out += _fused(par, name, leaf, p, style)
        varies = _input_varies(fam, styles, path, plan.sequence_parallel)
        if varies and (style is None or not style.linear):
            out += _replicated_on_varying(par, name, p, varies)
    return out


def _input_varies(fam, styles: dict[str, TpStyle], path: str, sequence_parallel: bool) -> str:
    """Why the input of block-level module `path` varies over tp ('' when it does not)."""
    for sub in (fam.attention_path, fam.mlp_path):
        if path.startswith(sub + "."):
            split = [p for p, rec in styles.items() if p.startswith(sub + ".") and rec.splits_output]
            return f"it reads {split[0]}'s output, split over tp" if split else ""
    return "sequence parallelism cuts the block's tokens over tp" if sequence_parallel else ""


def _replicated_on_varying(par, name: str, p, varies: str) -> list[LintFinding]:
    """A weight whole on every tp rank whose input varies over tp: its gradient must be summed over tp."""
    placement = _on(p, "tp")
    if placement is None:
        return [_finding(
            name, "tp", LintKind.GRAD_NOT_REDUCED, LintSeverity.WRONG,
            f"{varies}, but the weight is a plain tensor on tp: each rank's gradient covers only its own part "
            "and nothing sums it, so the tp replicas drift apart",
            "make it a Replicate DTensor on tp fed a DTensor input (a sequence-parallel norm: list it in "
            "FamilyInfo.norm_paths; a per-head norm: the style 'replicated_with_grad_allreduce'), "
            "so DTensor sums its gradient")]
    if not isinstance(placement, Replicate):
        return []
    if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None):
        return [_finding(
            name, "tp", LintKind.REDUCED_TWICE, LintSeverity.WRONG,
            f"{varies}, so DTensor already sums its gradient over tp; a hook on the weight may sum it again "
            "(tp times too large)", "keep one of the two: the Replicate DTensor's own reduction, or the hook")]
    data = [a for a in DATA_AXES if getattr(par.plan, a) > 1 and _on(p, a) is not None]
    if data or REDUCE_PARTIAL[0]:
        return []  # FSDP2 / replicate, or else finish_grads, reduce it once after backward
    return [_finding(
        name, "tp", LintKind.IMPLICIT_REDISTRIBUTE, LintSeverity.COST,
        f"{varies}, so its gradient leaves backward Partial on tp and nothing reduces it before the optimizer, "
        "whose ops then all-reduce it implicitly, once per operand that reads it, every step",
        "reduce it once after backward (the runtime's own reduction: "
        "runtime.layout.parallelized.REDUCE_PARTIAL on, its default)")]


def _fused(par, name: str, leaf: str, p, style: TpStyle | None) -> list[LintFinding]:
    """A fused [q | k | v] projection split over tp: each rank's shard must hold whole heads of each."""
    from ..parallel.tp import fused_qkv_permutation

    spec = par.spec
    out_dim = (1 if spec.family_info.weights_transposed else 0) if leaf == "weight" else 0
    placement, tp = _on(p, "tp"), par.plan.tp
    q, kv = spec.width("q"), spec.width("kv")
    if not (isinstance(placement, Shard) and placement.dim == out_dim):
        return []
    if style is not None and style.gathers_output:
        return [_finding(
            name, "tp", LintKind.WHOLE_EACH_STEP, LintSeverity.COST,
            f"its split output is all-gathered whole ({q + 2 * kv} features per token) every forward, and its "
            "gradient sliced back", "the style 'colwise_fused_qkv' keeps each rank's heads local")]
    kept = par.perms.get(name)
    if kept is not None and kept[1].tolist() == fused_qkv_permutation(q, kv, tp).tolist():
        return []
    width = q + 2 * kv
    share = width // tp
    parts = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, width)}
    held = ", ".join(f"{k} {max(0, min(b, share) - a) / (b - a):.0%}" for k, (a, b) in parts.items())
    return [_finding(
        name, "tp", LintKind.SPLIT_FUSED, LintSeverity.WRONG,
        f"its {width} output features [q | k | v] are split over tp as they are: rank 0 holds features "
        f"0-{share - 1} ({held}), so each rank's heads mix queries, keys and values",
        "the style 'colwise_fused_qkv' (regroups the features per head before the split)")]


def _partial_outputs(par, held: dict) -> list[LintFinding]:
    """A TP style that hands its output on as a plain tensor while it is still a partial sum over tp."""
    from ..parallel.tp import layer_tp_plan, vocab_tp_plan

    prefix = par.spec.family_info.layers_path + "."
    layer_ids = sorted({int(n[len(prefix):].split(".")[0]) for n in held if n.startswith(prefix)})
    styles = layer_tp_plan(par.spec, layer_ids, par.plan.sequence_parallel)
    if par.plan.vocab_split:
        styles.update(vocab_tp_plan(par.spec, loss_parallel=par.plan.loss_parallel))
    out = []
    for path, style in styles.items():
        layouts = getattr(style, "output_layouts", None)
        layouts = layouts if isinstance(layouts, tuple) else (layouts,)
        if getattr(style, "use_local_output", False) and any(isinstance(x, Partial) for x in layouts):
            out.append(_finding(
                path, "tp", LintKind.PARTIAL_OUTPUT, LintSeverity.WRONG,
                f"{type(style).__name__} hands on a partial sum over tp as a plain tensor: the next non-linear "
                "op reads each rank's unsummed part", "output_layouts Replicate() (all-reduce) or Shard(1) "
                "(reduce-scatter, sequence parallel), or keep the DTensor (use_local_output=False)"))
    return out
