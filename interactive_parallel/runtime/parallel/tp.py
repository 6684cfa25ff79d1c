"""Tensor parallel: weight matrices of the decoder layers split across the tp mesh axis.

Owns turning a family's TP plan (FamilyInfo.tp_plan, module path -> style name: the names of
transformers' own `base_model_tp_plan`, each style's facts its record's in plan.tp_styles) into
torch's DTensor ParallelStyles: colwise and rowwise, their gathered-output and split-input
variants, per-head norms replicated with their gradient summed over tp (`ReplicatedHeadNorm`),
linears whose weight is stored transposed (transformers' Conv1D, FamilyInfo.weights_transposed)
and fused q|k|v projections (a style packed 'qkv': 'colwise_fused_qkv', regrouped per head
first), sequence parallelism of the norms,
and rewriting the attention modules' head bookkeeping for the local shard
(FamilyInfo.local_head_attrs). Also the vocabulary ends (Plan.vocab_split, the default under
tp), as the model's own TP plan has them (transformers' 'embedding_rowwise' and
'colwise_gather_output', torchtitan's plan): the token embedding rowwise on the vocabulary (its
output all-reduced, whole), the LM head colwise with its logits all-gathered for the plain loss,
or under Plan.loss_parallel left split on the vocabulary as a DTensor for runtime.model.loss to
take the cross-entropy on (a tied pair is one weight, split once: both styles shard the
[vocab, hidden] matrix on dim 0). Plan(vocab_parallel=False) keeps both whole on every tp rank.

Where this differs from torchtitan (models/llama3/parallelize.py) and why: under sequence
parallelism torchtitan's embedding reduce-scatters straight to sequence shards, its final norm
runs on sequence shards and its head gathers its input once. Here the embedding's output is
all-reduced whole and cut at the first layer, and the last layer's output is gathered whole
before the final norm and the head (`_sequence_boundaries`), because the model is
transformers' own and its forward reads both ends at the whole sequence's length: the position
ids and the causal mask are derived from the embedding output's length (GPT-2 adds its learned
positions there), and after the final norm GPT-2 views the hidden states to the input's shape
and logits_to_keep slices positions (measured: a GPT-2 whose final norm ran on sequence shards
fails that view). The cost: at each end one [b, s, h] all-reduce (the embedding's output in the
forward, the head's input gradient in the backward) where torchtitan reduce-scatters, half of it
on the wire; the gathers match. A pipeline stage boundary sees the whole sequence too.
Reads the family's facts and each style's record, never a family's or a style's name; the
model code is never edited. Knows nothing of other mesh axes or of how the model is trained.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from ...plan import ModelSpec
from ...plan.tp_styles import TP_STYLES, tp_style


def _distribute(module: nn.Module, mesh, placements: dict[str, list]) -> None:
    for name, spec in placements.items():
        param = getattr(module, name, None)
        if param is None:
            continue
        # src_data_rank=None: every rank built the same full weights, so each just keeps its
        # own slice; no scatter, no collective that one failing rank could hang.
        dt = distribute_tensor(param.data, mesh, spec, src_data_rank=None)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


class Colwise(ColwiseParallel):
    """ColwiseParallel that also takes a transposed (in, out) weight (Conv1D): weight Shard(1), bias Shard(0).

    x [b, s, h] (replicated) -> y [b, s, out/tp] (sharded on the last dim).
    """

    def __init__(self, *, transposed: bool = False, **kw):
        super().__init__(**kw)
        self.transposed = transposed

    def _apply(self, module: nn.Module, device_mesh):
        if not self.transposed:
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh,
            lambda _n, mod, mesh: _distribute(mod, mesh, {"weight": [Shard(1)], "bias": [Shard(0)]}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Rowwise(RowwiseParallel):
    """RowwiseParallel that also takes a transposed (in, out) weight (Conv1D): weight Shard(0), bias Replicate.

    x [b, s, in/tp] (sharded on the last dim) -> y [b, s, h] (all-reduced; or [b, s/tp, h] under SP).
    """

    def __init__(self, *, transposed: bool = False, **kw):
        super().__init__(**kw)
        self.transposed = transposed

    def _apply(self, module: nn.Module, device_mesh):
        if not self.transposed:
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda _n, mod, mesh: _distribute(mod, mesh, {"weight": [Shard(0)], "bias": [Replicate()]}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def fused_qkv_permutation(q: int, kv: int, tp: int) -> torch.Tensor:
    """Output-feature order that turns [q | k | v] into [q0 k0 v0 | q1 k1 v1 | ...] (one block per tp rank).

    A plain split of the fused projection would give rank 0 all of q and part of k;
    permuting first makes each rank's contiguous shard hold the q, k and v of its own heads.
    """
    parts = (torch.arange(q), q + torch.arange(kv), q + kv + torch.arange(kv))
    pieces = [p.chunk(tp) for p in parts]  # (q|k|v) x tp pieces of q/tp or kv/tp features
    return torch.cat([piece[r] for r in range(tp) for piece in pieces])


def permute(full: torch.Tensor, dim: int, perm: torch.Tensor) -> torch.Tensor:
    """A fused weight in checkpoint order -> its permuted (sharded) layout along `dim`."""
    return full.index_select(dim, perm).contiguous()


def unpermute(full: torch.Tensor, dim: int, perm: torch.Tensor) -> torch.Tensor:
    """The checkpoint layout of a fused weight gathered in its permuted (sharded) layout."""
    return full.index_select(dim, torch.argsort(perm)).contiguous()


class ReplicatedHeadNorm(ParallelStyle):
    """A norm applied to each head of a colwise projection's local heads (Qwen3's q_norm and
    k_norm): its weight whole on every tp rank, as a replicated DTensor, and its input taken as
    this rank's shard of the heads dim, so autograd sums the weight's gradient over tp (each
    rank's covers only its own heads). transformers' 'replicated_with_grad_allreduce' does the
    sum with a gradient hook; here DTensor does it, which FSDP2 and DCP then see as any other
    tp-replicated parameter.

    x [b, s, heads/tp, d] (local) -> y [b, s, heads/tp, d] (local).
    """

    def _apply(self, module: nn.Module, device_mesh):
        def partition(_name, mod, mesh):
            _distribute(mod, mesh, {n: [Replicate()] for n, _ in mod.named_parameters(recurse=False)})

        def to_dtensor(_mod, inputs, mesh):
            from torch.distributed.tensor import DTensor

            x = inputs[0]
            return (DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False), *inputs[1:])

        return distribute_module(module, device_mesh, partition, to_dtensor, lambda _m, out, _mesh: out.to_local())


def _style(style: str, transposed: bool, out_layout) -> nn.Module:
    """Our ParallelStyle for a style name, built as its record says (plan.tp_styles: transformers'
    names, mapped onto torch's styles)."""
    rec = tp_style(style)
    if not rec.linear:  # a per-head norm: whole on every rank, its gradient summed over tp
        return ReplicatedHeadNorm()
    if rec.shards == "output":
        return Colwise(transposed=transposed, output_layouts=Replicate()) if rec.gathers_output \
            else Colwise(transposed=transposed)
    if rec.slices_input:
        return Rowwise(transposed=transposed, input_layouts=Replicate(), output_layouts=out_layout)
    return Rowwise(transposed=transposed, output_layouts=out_layout)


def layer_tp_plan(spec: ModelSpec, layer_ids, sequence_parallel: bool) -> dict[str, nn.Module]:
    """Module path -> ParallelStyle for the given decoder layers (the family's tp_plan, expanded)."""
    fam = spec.family_info
    out_layout = Shard(1) if sequence_parallel else Replicate()  # rowwise output [b, s/tp, h] or [b, s, h]
    return {pattern.replace("*", str(i)): _style(style, fam.weights_transposed, out_layout)
            for pattern, style in fam.tp_plan.items() for i in layer_ids}


def _sp_plan(spec: ModelSpec, layer_ids) -> dict[str, nn.Module]:
    """Norms run on sequence shards; attention and MLP gather the sequence at their input."""
    fam = spec.family_info

    def gather(kwarg: str | None = None) -> PrepareModuleInput:  # [b, s/tp, h] -> [b, s, h] at the input
        if kwarg:
            return PrepareModuleInput(input_kwarg_layouts={kwarg: Shard(1)},
                                      desired_input_kwarg_layouts={kwarg: Replicate()})
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    plan: dict[str, nn.Module] = {}
    for i in layer_ids:
        block = f"{fam.layers_path}.{i}"
        for norm in fam.norm_paths:
            # [b, s/tp, h] in and out, local: a post-norm (Gemma 3, OLMo 2) feeds the residual add directly
            plan[f"{block}.{norm}"] = SequenceParallel(use_local_output=True)
        plan[f"{block}.{fam.attention_path}"] = gather(fam.attention_input)
        plan[f"{block}.{fam.mlp_path}"] = gather()
    return plan


def localize_attention(model: nn.Module, spec: ModelSpec, layer_ids, tp: int) -> None:
    """Divide the attention attributes that hold global widths (FamilyInfo.local_head_attrs) by tp.

    Llama reshapes with view(..., -1, head_dim), so its local shapes follow by themselves
    (num_key_value_groups is a ratio and stays right): it lists none. GPT-2 splits c_attn's
    output with split_size = embed_dim, a global width: it must become the local width.
    """
    fam = spec.family_info
    layers = model.get_submodule(fam.layers_path)
    for i in layer_ids:
        attn = layers[i].get_submodule(fam.attention_path)
        for attr in fam.local_head_attrs:
            setattr(attn, attr, getattr(attn, attr) // tp)


def _permute_fused(model: nn.Module, spec: ModelSpec, layer_ids, tp: int) -> dict:
    """Regroup each projection of a packed q|k|v style (TpStyle.packed 'qkv': 'colwise_fused_qkv') per
    head, in place; {param name: (dim, perm)}."""
    fam = spec.family_info
    perm = fused_qkv_permutation(spec.width("q"), spec.width("kv"), tp)
    weight_dim = 1 if fam.weights_transposed else 0  # the output features of the weight
    perms: dict[str, tuple[int, torch.Tensor]] = {}
    for pattern, style in fam.tp_plan.items():
        if TP_STYLES[style].packed != "qkv":
            continue
        for i in layer_ids:
            path = pattern.replace("*", str(i))
            module = model.get_submodule(path)
            for leaf, dim in (("weight", weight_dim), ("bias", 0)):
                param = getattr(module, leaf, None)
                if param is None:
                    continue
                with torch.no_grad():
                    param.data = permute(param.data, dim, perm)
                perms[f"{path}.{leaf}"] = (dim, perm)
    return perms


def vocab_tp_plan(spec: ModelSpec, *, loss_parallel: bool = False, embedding: bool = True,
                  head: bool = True) -> dict[str, nn.Module]:
    """Module path -> ParallelStyle of the vocabulary ends (Plan.vocab_split): the model's own TP
    plan (transformers' 'embedding_rowwise' and 'colwise_gather_output', torchtitan's).

    Embedding: ids [b, s] (replicated) -> each rank looks up its vocab rows, zeros elsewhere,
    all-reduced -> [b, s, h] whole (sequence parallelism cuts it at the first layer, as it does
    without). Head: [b, s, h] whole (the last layer gathers the sequence) -> [b, s, vocab/tp],
    all-gathered to [b, s, vocab] for the plain loss, or (loss_parallel) kept as a DTensor
    Shard(-1) that the loss and the greedy pick read split.
    """
    fam = spec.family_info
    plan: dict[str, nn.Module] = {}
    if embedding:
        plan[fam.embedding_path] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if head:
        logits = dict(output_layouts=Shard(-1), use_local_output=False) if loss_parallel else \
            dict(output_layouts=Replicate())
        plan[fam.lm_head_path] = Colwise(transposed=False, input_layouts=Replicate(), **logits)
    return plan


def _retie(model: nn.Module, spec: ModelSpec) -> None:
    """Both styles made a Parameter of their own from the one tied weight (the same Shard(0) of
    [vocab, hidden]): the head takes the embedding's again, so there is one weight and one gradient."""
    fam = spec.family_info
    model.get_submodule(fam.lm_head_path).weight = model.get_submodule(fam.embedding_path).weight


def _shard_embedding_grad(module: nn.Module, _args) -> None:
    """DTensor's embedding backward gives the vocabulary-split weight a whole [vocab, h] gradient
    (Replicate, measured): each rank keeps only its rows of it (a local slice, no collective), so
    the gradient is 1/tp per rank like the weight and a tied pair's two gradients match (the
    tie's all-reduce over pipeline stages needs the same shape on both). Registered at the first
    forward, on the weight the forward then sees: `to_empty` swaps tensors, hooks with them."""
    w = module.weight
    if getattr(w, "_ip_grad_sharded", False) or not hasattr(w, "placements"):
        return
    mesh, placements = w.device_mesh, w.placements
    w.register_hook(lambda g: g if g.placements == placements else g.redistribute(mesh, placements))
    w._ip_grad_sharded = True


def apply_tp(model: nn.Module, mesh, spec: ModelSpec, layer_ids, *, sequence_parallel: bool = False,
             vocab_split: bool = True, loss_parallel: bool = False, compiled: bool = False,
             recomputed: bool = False) -> dict:
    """Shard the given decoder layers of `model` over the 1-D tp `mesh`, in place, and (vocab_split:
    Plan.vocab_split) the token embedding and the LM head on the vocabulary. `compiled`: the blocks
    will be compiled (Plan.compile); `recomputed`: their forwards re-run in backward (Plan.recompute).

    Returns {param name: (dim, permutation)} for fused weights whose sharded logical
    layout differs from the checkpoint layout (full_state_dict undoes it).
    """
    tp = mesh.size()
    perms = _permute_fused(model, spec, layer_ids, tp)
    plan = layer_tp_plan(spec, layer_ids, sequence_parallel)
    if sequence_parallel:
        plan.update(_sp_plan(spec, layer_ids))
    if vocab_split:
        plan.update(vocab_tp_plan(spec, loss_parallel=loss_parallel))
    parallelize_module(model, mesh, plan, src_data_rank=None)
    if vocab_split:
        if spec.tied_embeddings:
            _retie(model, spec)
        embedding = model.get_submodule(spec.family_info.embedding_path)
        embedding.register_forward_pre_hook(_shard_embedding_grad)
        if compiled:
            embedding.register_forward_hook(_own_tensor)
    localize_attention(model, spec, layer_ids, tp)
    if sequence_parallel:
        _sequence_boundaries(model.get_submodule(spec.family_info.layers_path), sorted(layer_ids), mesh, recomputed)
    return perms


def _own_tensor(_module: nn.Module, _args, out: torch.Tensor) -> torch.Tensor:
    """The split embedding's output as a tensor of its own, not the view of the DTensor's local
    tensor that `to_local` returns: a compiled first block given that view as its input handed
    its gradient back past `to_local`'s backward, so the embedding's redistribute received a plain
    tensor where it needs a DTensor and the backward failed (measured: tiny-llama tp2, compiled).
    One [b, s, h] copy per forward, under compile only."""
    return out.clone()


def _sequence_boundaries(layers: nn.ModuleList, layer_ids: list[int], mesh, recomputed: bool) -> None:
    """Between sequence-parallel layers the residual stream is (batch, seq / tp, hidden).

    It is cut at the first layer of each run of sharded layers and gathered after the last,
    so embeddings, the final norm and the LM head (and pipeline stage boundaries) keep
    seeing the whole sequence (the module docstring says why, where torchtitan differs).
    DTensor redistribute gives both cuts the right backward.
    """
    from torch.distributed.tensor import DTensor

    from ..model.recomputed import in_backward

    ids = set(layer_ids)
    # Recomputation (Plan.recompute) calls the layer again in backward with the inputs its
    # checkpoint saved, which are already cut: cutting again would halve the sequence twice, and
    # gathering a discarded output would issue an all-gather nobody needs. Without it nothing is
    # asked: a compiled block traces these hooks whole, and dynamo cannot trace autograd's question.
    again = in_backward if recomputed else (lambda: False)

    def cut(_mod, args, kwargs):
        if again():
            return None
        x = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)  # [b, s, h]
        return (x.redistribute(mesh, [Shard(1)]).to_local(), *args[1:]), kwargs  # [b, s/tp, h]

    def gather(_mod, _args, out):
        if again():
            return None
        x = out[0] if isinstance(out, tuple) else out  # [b, s/tp, h]
        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        full = x.redistribute(mesh, [Replicate()]).to_local()  # [b, s, h]
        # A copy, not the view to_local gives: FSDP2/replicate wrap this layer's output with
        # their pre-backward hook, which an in-place op on a view would silently drop.
        full = full.clone()
        return (full, *out[1:]) if isinstance(out, tuple) else full

    for i in layer_ids:
        if i - 1 not in ids:
            layers[i].register_forward_pre_hook(cut, with_kwargs=True)
        if i + 1 not in ids:
            layers[i].register_forward_hook(gather)
