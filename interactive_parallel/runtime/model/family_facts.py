"""A family's facts read from transformers: the config class's plans and the model built on the
meta device, with no numerical check.

Owns `derive_unchecked(config, name) -> FamilyInfo` and what it reads: the config's
`base_model_tp_plan` (kept as transformers names the styles, aliases folded, refused where
plan.tp_styles has no record of a style or its record says a config may not name it),
`base_model_pp_plan` (what runs before, around and after the block list) and `base_model_ep_plan`
(the stacked experts of a mixture of experts, each style's facts its record's in plan.ep_styles),
and of the meta model the module paths, every block linear's shape and bias, the norms and what
else a block holds, the LM head, the rotary table and how a block hands attention its input (read
from the block's own source); also building a config and its model on the meta device, and one
forward there that checks every shape (`forward_on_meta`). Refusals are UnknownModelError. Knows
nothing of the small copy that checks these facts numerically (runtime.model.family_check), of
caching, or of plans, meshes and ranks. Imports torch and transformers only inside functions.
"""
from __future__ import annotations

import inspect
import re
from typing import Any

from ...plan.models import ExpertsInfo, FamilyInfo, Linear, ModelSpec, UnknownModelError
from ...plan.ep_styles import EP_STYLES
from ...plan.tp_styles import TP_ALIASES, TP_STYLES


def built_config(config: dict, name: str):
    from .models import make_config

    try:
        return make_config(ModelSpec(name=name, family=config.get("model_type", ""), config=config))
    except Exception as exc:  # noqa: BLE001 - transformers says what it refuses in its own words
        raise UnknownModelError(f"transformers refuses the config of {name!r}: {type(exc).__name__}: {exc}") from None


def meta_model(config: dict, name: str):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = built_config(config, name)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001
        raise UnknownModelError(f"transformers cannot build {name!r} ({cfg.model_type}) as a causal LM: "
                                f"{type(exc).__name__}: {exc}") from None


def forward_on_meta(model, name: str) -> None:
    """A forward of `model` run on the meta device: every shape checked, nothing computed (a
    kv-head count that does not divide the heads fails here, not in a rank's first step)."""
    import torch

    config = model.config
    experts = getattr(config, "_experts_implementation", None)
    try:
        # torch's grouped_mm has a meta kernel for bf16 only; batched_mm gives the same shapes
        if experts is not None:
            config._experts_implementation = "batched_mm"
        with torch.device("meta"), torch.no_grad():
            model(torch.zeros(1, 8, dtype=torch.long))
    except NotImplementedError:
        return  # an op with no meta kernel: the shapes are not known wrong, only unchecked
    except Exception as exc:  # noqa: BLE001
        if "on meta tensors" in str(exc):  # a value read on the host (GPT-2's .item()): unchecked, as above
            return
        raise UnknownModelError(f"{name}: a forward of the model its config describes fails: "
                                f"{type(exc).__name__}: {str(exc)[:300]}") from None
    finally:
        if experts is not None:
            config._experts_implementation = experts


def _one(found: list[str], what: str, where: str, name: str) -> str:
    if len(found) != 1:
        raise UnknownModelError(f"{name}: cannot tell {what} in {where} (found {found or 'none'})")
    return found[0]


def derive_unchecked(config: dict, name: str) -> FamilyInfo:
    """The facts from the config's plans and the meta model (no numerical check)."""
    from torch import nn
    cfg = built_config(config, name)
    model_type = cfg.model_type
    tp_plan, pp_plan = getattr(cfg, "base_model_tp_plan", None), getattr(cfg, "base_model_pp_plan", None)
    if not tp_plan or not pp_plan:
        missing = " and ".join(w for w, p in (("TP", tp_plan), ("PP", pp_plan)) if not p)
        raise UnknownModelError(f"{name}: transformers' {type(cfg).__name__} ships no {missing} plan "
                                "(base_model_tp_plan / base_model_pp_plan), so its layout cannot be derived")
    model = meta_model(config, name)
    prefix = model.base_model_prefix
    base = model.get_submodule(prefix)
    names = list(pp_plan)
    layers_key = _one([k for k in names if isinstance(base.get_submodule(k), nn.ModuleList)],
                      "the block list", "base_model_pp_plan", name)
    before, after = names[:names.index(layers_key)], names[names.index(layers_key) + 1:]
    if not before or len(after) != 1:
        raise UnknownModelError(f"{name}: base_model_pp_plan {names} is not embeddings, blocks, final norm")
    extra = [k for k in before[1:] if not isinstance(base.get_submodule(k), nn.Dropout)]
    if extra:
        raise UnknownModelError(f"{name}: modules {extra} run between the embeddings and the blocks; only a "
                                "dropout is laid out there")
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    lm_head = _one([n for n, m in modules.items() if m is head], "the LM head", "the model", name)
    rotary = [n for n, m in base.named_children() if "rotary" in type(m).__name__.lower()]
    if len(rotary) > 1:
        raise UnknownModelError(f"{name}: several rotary tables {rotary}; one is laid out")
    blocks = base.get_submodule(layers_key)
    block = blocks[0]
    _same_blocks(blocks, name)
    parts = _block_facts(block, name)
    experts = _experts_facts(cfg, block, parts["mlp_path"], name)
    if experts is not None:  # the experts stay whole under tp; the dense-MLP entries name no module here
        tp_plan = {k: v for k, v in tp_plan.items()
                   if not k.startswith(f"{layers_key}.*.{experts.experts_path}") and _has(block, k, layers_key)}
        covered = {f"{experts.experts_path}.{leaf}" for leaf in experts.expert_params}
        parts["block_params"] = {k: v for k, v in parts["block_params"].items() if k not in covered}
    styles = _tp_styles(tp_plan, layers_key, block, name)
    forward_on_meta(model, name)
    return FamilyInfo(
        model_types=(model_type,),
        layers_path=f"{prefix}.{layers_key}",
        embedding_path=f"{prefix}.{before[0]}",
        embedding_dropout_path=f"{prefix}.{before[1]}" if len(before) > 1 else None,
        rotary_path=f"{prefix}.{rotary[0]}" if rotary else None,
        final_norm_path=f"{prefix}.{after[0]}",
        lm_head_path=lm_head,
        **parts,
        tp_plan={f"{prefix}.{layers_key}.*.{rel}": style for rel, style in styles.items()},
        tied_by_default=bool(getattr(cfg, "tie_word_embeddings", False)),
        logit_softcap="final_logit_softcapping" if getattr(cfg, "final_logit_softcapping", None) else "",
        logit_divisor="logits_scaling" if getattr(cfg, "logits_scaling", 1.0) not in (None, 1, 1.0) else "",
        layer_windows=_windows(cfg),
        layer_types=_rotary_types(cfg, base, rotary),
        experts=experts,
    )


def _has(block, pattern: str, layers_key: str) -> bool:
    try:
        block.get_submodule(pattern[len(f"{layers_key}.*."):])
        return True
    except AttributeError:
        return False


def _same_blocks(blocks, name: str) -> None:
    """Every block holds the same parameters: the facts are one block's (a model whose first
    blocks are dense and the rest sparse, DeepSeek-V3's first_k_dense_replace, is refused)."""
    first = [n for n, _ in blocks[0].named_parameters()]
    odd = [i for i, b in enumerate(blocks) if [n for n, _ in b.named_parameters()] != first]
    if odd:
        raise UnknownModelError(f"{name}: blocks {odd[:8]} hold other parameters than block 0 (dense and "
                                "mixture-of-experts blocks mixed); one kind of block is laid out")


def _experts_facts(cfg, block, mlp: str, name: str) -> ExpertsInfo | None:
    """The block's mixture of experts, from the config's `base_model_ep_plan` and the modules its
    sparse block holds (None: a dense block)."""
    ep_plan = getattr(cfg, "base_model_ep_plan", None)
    if not ep_plan:
        return None
    sparse = block.get_submodule(mlp)
    children = dict(sparse.named_children())
    dispatch = [k for k, v in ep_plan.items() if v in EP_STYLES and EP_STYLES[v].dispatches]
    experts_rel = _one([k.split(".*.", 1)[1] for k in dispatch], "the experts module", "base_model_ep_plan", name)
    router = _one([n for n, m in children.items() if "router" in type(m).__name__.lower()],
                  "the router", f"the sparse block {mlp}", name)
    experts = block.get_submodule(experts_rel)
    if not hasattr(experts, "num_experts"):
        raise UnknownModelError(f"{name}: {experts_rel} ({type(experts).__name__}) does not hold its experts "
                                "stacked as transformers' experts interface does")
    odd = [k for k, v in ep_plan.items() if v not in EP_STYLES]
    if odd:
        raise UnknownModelError(f"{name}: its EP plan uses styles {sorted({ep_plan[k] for k in odd})}; "
                                f"{' and '.join(EP_STYLES)} are laid out")
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    return ExpertsInfo(
        block_path=mlp, router_path=f"{mlp}.{router}", experts_path=experts_rel,
        expert_params={n: tuple(p.shape[1:]) for n, p in experts.named_parameters()},
        expert_width=int(width), ep_plan=dict(ep_plan),
        aux_loss_key="router_aux_loss_coef" if getattr(cfg, "router_aux_loss_coef", None) else "")


def _block_facts(block, name: str) -> dict[str, Any]:
    """What one decoder block holds, as FamilyInfo fields: its attention and MLP, its norms, every
    linear's shape and bias, the parameters outside those (q/k norms), and what the activation
    model reads of them (norm kind, a gated MLP)."""
    from torch import nn

    children = dict(block.named_children())
    attention = _one([n for n, m in children.items() if type(m).__name__.endswith("Attention")],
                     "the attention module", "a block", name)
    mlp = _one([n for n, m in children.items() if "MLP" in type(m).__name__]
               or [n for n in children if n == "mlp"], "the MLP", "a block", name)
    norms = tuple(n for n, m in children.items() if "norm" in type(m).__name__.lower())
    linears, covered = {}, set()
    for path, m in block.named_modules():
        if isinstance(m, nn.Linear):
            linears[path] = Linear(m.in_features, m.out_features, m.bias is not None)
            covered |= {f"{path}.weight", f"{path}.bias"}
    covered |= {f"{n}.{leaf}" for n in norms for leaf in ("weight", "bias")}
    norm_bias = bool(norms) and getattr(block.get_submodule(norms[0]), "bias", None) is not None
    gated = any("gate" in p.rsplit(".", 1)[-1] for p in linears if p.startswith(f"{mlp}."))
    return dict(attention_path=attention, attention_input=_attention_input(block, attention), mlp_path=mlp,
                norm_paths=norms, norm_bias=norm_bias, norm_saves=(1, 2) if norm_bias else (2, 1),
                mlp_saves=4 if gated else 3, linears=linears,
                block_params={n: tuple(p.shape) for n, p in block.named_parameters() if n not in covered})


def _tp_styles(tp_plan: dict[str, str], layers_key: str, block, name: str) -> dict[str, str]:
    """Block level path -> our style name (transformers' names, aliases folded), or refuse."""
    from torch import nn
    prefix = f"{layers_key}.*."
    out = {}
    for pattern, style in tp_plan.items():
        style = TP_ALIASES.get(style, style)
        if not pattern.startswith(prefix):
            raise UnknownModelError(f"{name}: its TP plan splits {pattern!r} ({style}), outside the blocks; "
                                    "only block modules are split here")
        rel = pattern[len(prefix):]
        record = TP_STYLES.get(style)
        if record is None or not record.from_transformers:
            mapped = ", ".join(s.name for s in TP_STYLES.values() if s.from_transformers)
            raise UnknownModelError(f"{name}: its TP plan gives {pattern!r} the style {style!r}, which is not "
                                    f"mapped here (mapped: {mapped})")
        try:
            module = block.get_submodule(rel)
        except AttributeError:
            raise UnknownModelError(f"{name}: its TP plan names {pattern!r}, which a block does not have") from None
        if record.linear and not isinstance(module, nn.Linear):
            raise UnknownModelError(f"{name}: its TP plan splits {pattern!r} ({type(module).__name__}) as "
                                    f"{style}; only linears are split so")
        out[rel] = style
    return out


def _windows(cfg) -> tuple[int | None, ...]:
    """Each block's sliding window: the config's layer types where it has them, else every block
    when the config sets a window (Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return ()
    types = getattr(cfg, "layer_types", None)
    if types:
        out = tuple(int(window) if t == "sliding_attention" else None for t in types)
        return out if any(out) else ()
    return (int(window),) * cfg.num_hidden_layers


def _rotary_types(cfg, base, rotary: list[str]) -> tuple[str, ...]:
    """The config's layer types when its rotary table is asked per type (Gemma 3), else ()."""
    if not rotary:
        return ()
    params = inspect.signature(base.get_submodule(rotary[0]).forward).parameters
    return tuple(cfg.layer_types) if "layer_type" in params else ()


def _attention_input(block, attention: str) -> str | None:
    """The keyword a block hands attention its hidden states by (None: positionally)."""
    try:
        source = inspect.getsource(type(block).forward)
    except (OSError, TypeError):
        return None
    found = re.search(rf"self\.{re.escape(attention)}\(\s*(\w+)\s*=", source)
    return found.group(1) if found else None

