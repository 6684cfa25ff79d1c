"""Tensor parallel: weight matrices of the decoder layers split across the tp mesh axis.

Owns turning a family's TP plan (plan.models.FAMILIES[...].tp_plan, module path -> style
name) into DTensor ParallelStyles, the styles for GPT-2's Conv1D (weight stored (in, out))
and its fused q|k|v projection, sequence parallelism of the norms, and rewriting the
attention modules' head bookkeeping for the local shard. The model code is never edited.
Knows nothing of other mesh axes or of how the model is trained.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from ...plan import ModelSpec


def _is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D: a Linear whose weight is stored transposed (in, out).
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


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
    """ColwiseParallel that also takes Conv1D (weight Shard(1), bias Shard(0))."""

    def _apply(self, module: nn.Module, device_mesh):
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh,
            lambda _n, mod, mesh: _distribute(mod, mesh, {"weight": [Shard(1)], "bias": [Shard(0)]}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Rowwise(RowwiseParallel):
    """RowwiseParallel that also takes Conv1D (weight Shard(0), bias Replicate)."""

    def _apply(self, module: nn.Module, device_mesh):
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda _n, mod, mesh: _distribute(mod, mesh, {"weight": [Shard(0)], "bias": [Replicate()]}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def fused_qkv_permutation(hidden: int, tp: int) -> torch.Tensor:
    """Column order that turns [q | k | v] into [q0 k0 v0 | q1 k1 v1 | ...] (one block per tp rank).

    A plain column split of the fused projection would give rank 0 all of q and part of k;
    permuting first makes each rank's contiguous shard hold the q, k and v of its own heads.
    """
    per = hidden // tp
    idx = torch.arange(3 * hidden).view(3, tp, per)  # (q|k|v, rank, column)
    return idx.transpose(0, 1).reshape(-1)


def permute_fused_qkv(module: nn.Module, perm: torch.Tensor) -> None:
    with torch.no_grad():
        module.weight.data = module.weight.data[:, perm].contiguous()
        module.bias.data = module.bias.data[perm].contiguous()


def unpermute(full: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The checkpoint layout of a fused weight gathered in its permuted (sharded) layout."""
    return full[..., torch.argsort(perm)].contiguous()


def permute(full: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return full[..., perm].contiguous()


def layer_tp_plan(spec: ModelSpec, layer_ids, sequence_parallel: bool) -> dict[str, nn.Module]:
    """Module path -> ParallelStyle for the given decoder layers."""
    out_layout = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, nn.Module] = {}
    for pattern, style in spec.family_info.tp_plan.items():
        for i in layer_ids:
            path = pattern.replace("*", str(i))
            if style.startswith("colwise"):
                plan[path] = Colwise()
            else:
                plan[path] = Rowwise(output_layouts=out_layout)
    return plan


def _sp_plan(spec: ModelSpec, layer_ids) -> dict[str, nn.Module]:
    """Norms run on sequence shards; attention and MLP gather the sequence at their input."""
    fam = spec.family_info
    lp = fam.layers_path
    plan: dict[str, nn.Module] = {}
    if spec.family == "llama":
        norms, attn_kw, mlp = ("input_layernorm", "post_attention_layernorm"), "hidden_states", "mlp"
    else:
        norms, attn_kw, mlp = ("ln_1", "ln_2"), None, "mlp"
    for i in layer_ids:
        for n in norms:
            plan[f"{lp}.{i}.{n}"] = SequenceParallel()
        if attn_kw:
            plan[f"{lp}.{i}.{fam.attention_path}"] = PrepareModuleInput(
                input_kwarg_layouts={attn_kw: Shard(1)}, desired_input_kwarg_layouts={attn_kw: Replicate()})
        else:
            plan[f"{lp}.{i}.{fam.attention_path}"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan[f"{lp}.{i}.{mlp}"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def localize_attention(model: nn.Module, spec: ModelSpec, layer_ids, tp: int) -> None:
    """Head bookkeeping of each attention module for its local heads.

    Llama reshapes with view(..., -1, head_dim), so its local shapes follow by themselves
    (num_key_value_groups is a ratio and stays right). GPT-2 splits c_attn's output with
    split_size = embed_dim, a global width: it must become the local width.
    """
    if spec.family != "gpt2":
        return
    layers = model.get_submodule(spec.family_info.layers_path)
    for i in layer_ids:
        attn = layers[i].get_submodule(spec.family_info.attention_path)
        attn.split_size = attn.embed_dim // tp
        attn.num_heads = attn.num_heads // tp
        attn.embed_dim = attn.embed_dim // tp


def apply_tp(model: nn.Module, mesh, spec: ModelSpec, layer_ids, *, sequence_parallel: bool = False) -> dict:
    """Shard the given decoder layers of `model` over the 1-D tp `mesh`, in place.

    Returns {param name: column permutation} for fused weights whose sharded logical
    layout differs from the checkpoint layout (full_state_dict undoes it).
    """
    tp = mesh.size()
    layers = model.get_submodule(spec.family_info.layers_path)
    perms: dict[str, torch.Tensor] = {}
    for pattern, style in spec.family_info.tp_plan.items():
        if style != "colwise_fused_qkv":
            continue
        perm = fused_qkv_permutation(spec.hidden_size, tp)
        for i in layer_ids:
            path = pattern.replace("*", str(i))
            permute_fused_qkv(model.get_submodule(path), perm)
            perms[f"{path}.weight"] = perm
            perms[f"{path}.bias"] = perm
    plan = layer_tp_plan(spec, layer_ids, sequence_parallel)
    if sequence_parallel:
        plan.update(_sp_plan(spec, layer_ids))
    parallelize_module(model, mesh, plan, src_data_rank=None)
    localize_attention(model, spec, layer_ids, tp)
    if sequence_parallel:
        _sequence_boundaries(layers, sorted(layer_ids), mesh)
    return perms


def _sequence_boundaries(layers: nn.ModuleList, layer_ids: list[int], mesh) -> None:
    """Between sequence-parallel layers the residual stream is (batch, seq / tp, hidden).

    It is cut at the first layer of each run of sharded layers and gathered after the last,
    so embeddings, the final norm and the LM head (and pipeline stage boundaries) keep
    seeing the whole sequence. DTensor redistribute gives both cuts the right backward.
    """
    from torch.distributed.tensor import DTensor

    ids = set(layer_ids)

    def cut(_mod, args, kwargs):
        x = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
        return (x.redistribute(mesh, [Shard(1)]).to_local(), *args[1:]), kwargs

    def gather(_mod, _args, out):
        x = out[0] if isinstance(out, tuple) else out
        full = DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()
        # A copy, not the view to_local gives: FSDP2/replicate wrap this layer's output with
        # their pre-backward hook, which an in-place op on a view would silently drop.
        full = full.clone()
        return (full, *out[1:]) if isinstance(out, tuple) else full

    for i in layer_ids:
        if i - 1 not in ids:
            layers[i].register_forward_pre_hook(cut, with_kwargs=True)
        if i + 1 not in ids:
            layers[i].register_forward_hook(gather)
