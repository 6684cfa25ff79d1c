"""A model family's facts derived from transformers itself, for any decoder whose config ships
a TP and a PP plan.

Owns `derive(spec) -> FamilyInfo` and `with_facts(spec)`: the plain data plan/ reads
(plan.facts.FamilyInfo), taken from three places and never from the family's name:
- the config class's `base_model_tp_plan` (module pattern -> transformers' style name,
  kept as it is where plan.facts.TP_STYLES maps it) and `base_model_pp_plan` (which
  modules run before, around and after the block list), and for a mixture of experts its
  `base_model_ep_plan` (which module holds the stacked experts: ExpertsInfo; the TP plan's
  expert entries are dropped, the experts stay whole under tp);
- the model built on the meta device (no storage): module paths, every block linear's
  shape and bias, the norms and what else a block holds, the LM head, the rotary table,
  how a block hands attention its input (read from the block's own source);
- a small copy of the config (a few heads, two blocks, a short window) built whole on the
  CPU: what `_init_weights` gives a norm, what the base model's forward multiplies the
  embeddings by, and a check that the stage forward the pipeline and context parallel run
  (runtime.model.stage.StageModule, driven by these facts) gives the model's own logits.
  A family whose forward does something the facts do not say is refused there, with the
  difference named, rather than trained wrong.

Refusals are UnknownModelError, raised before any rank builds anything: a config transformers
refuses or whose model's forward fails on the meta device (every spec is checked so, the
hand-written families' too), a model type without the plans, a TP style not mapped here,
blocks that differ (dense and sparse mixed), an EP style not mapped, a stage forward the facts do not reproduce.
Derivations are cached per config. Importing this module costs nothing: torch and
transformers load when a spec is first checked (a client that only plans presets never
loads them). Knows nothing of plans, meshes or ranks.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import re

from typing import Any

from ...plan.models import (TP_ALIASES, TP_STYLES, ExpertsInfo, FamilyInfo, Linear, ModelSpec, UnknownModelError,
                             resolve_model)

CHECK_TOL = 1e-4
"""Largest |logit| difference the stage forward may show against the model's own on the small copy (fp32)."""
CHECK_SEQ = 12
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16, vocab_size=96)
"""The small copy's widths (its heads, kv heads and layer types follow the config's pattern)."""


def resolved(model: Any) -> ModelSpec:
    """plan.resolve_model(model), checked by transformers and with its family facts."""
    return with_facts(resolve_model(model))


def with_facts(spec: ModelSpec) -> ModelSpec:
    """`spec` with its family facts, derived when FAMILIES does not hold them; its config first
    built by transformers whatever the family, so one transformers refuses is refused here."""
    if spec.needs_facts:
        return dataclasses.replace(spec, facts=derive(spec))  # the derivation checks the shapes too
    _shapes_checked(json.dumps(spec.config, sort_keys=True, default=str), spec.name)
    return spec


@functools.lru_cache(maxsize=32)
def _shapes_checked(config_json: str, name: str) -> None:
    """A hand-written family's config built by transformers and its shapes checked (_forward_on_meta)."""
    _forward_on_meta(_meta_model(json.loads(config_json), name), name)


def _forward_on_meta(model, name: str) -> None:
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


def derive(spec: ModelSpec) -> FamilyInfo:
    return _derive(json.dumps(spec.config, sort_keys=True, default=str), spec.name)


@functools.lru_cache(maxsize=32)
def _derive(config_json: str, name: str) -> FamilyInfo:
    config = json.loads(config_json)
    return checked(config, name, derive_unchecked(config, name))


def _config(config: dict, name: str):
    from .models import make_config

    try:
        return make_config(ModelSpec(name=name, family=config.get("model_type", ""), config=config))
    except Exception as exc:  # noqa: BLE001 - transformers says what it refuses in its own words
        raise UnknownModelError(f"transformers refuses the config of {name!r}: {type(exc).__name__}: {exc}") from None


def _meta_model(config: dict, name: str):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _config(config, name)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001
        raise UnknownModelError(f"transformers cannot build {name!r} ({cfg.model_type}) as a causal LM: "
                                f"{type(exc).__name__}: {exc}") from None


def _one(found: list[str], what: str, where: str, name: str) -> str:
    if len(found) != 1:
        raise UnknownModelError(f"{name}: cannot tell {what} in {where} (found {found or 'none'})")
    return found[0]


def derive_unchecked(config: dict, name: str) -> FamilyInfo:
    """The facts from the config's plans and the meta model (no numerical check)."""
    from torch import nn
    cfg = _config(config, name)
    model_type = cfg.model_type
    tp_plan, pp_plan = getattr(cfg, "base_model_tp_plan", None), getattr(cfg, "base_model_pp_plan", None)
    if not tp_plan or not pp_plan:
        missing = " and ".join(w for w, p in (("TP", tp_plan), ("PP", pp_plan)) if not p)
        raise UnknownModelError(f"{name}: transformers' {type(cfg).__name__} ships no {missing} plan "
                                "(base_model_tp_plan / base_model_pp_plan), so its layout cannot be derived")
    model = _meta_model(config, name)
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
    _forward_on_meta(model, name)
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
    dispatch = [k for k, v in ep_plan.items() if v == "ep_dispatch_experts"]
    experts_rel = _one([k.split(".*.", 1)[1] for k in dispatch], "the experts module", "base_model_ep_plan", name)
    router = _one([n for n, m in children.items() if "router" in type(m).__name__.lower()],
                  "the router", f"the sparse block {mlp}", name)
    experts = block.get_submodule(experts_rel)
    if not hasattr(experts, "num_experts"):
        raise UnknownModelError(f"{name}: {experts_rel} ({type(experts).__name__}) does not hold its experts "
                                "stacked as transformers' experts interface does")
    odd = [k for k, v in ep_plan.items() if v not in ("grouped_gemm", "ep_dispatch_experts")]
    if odd:
        raise UnknownModelError(f"{name}: its EP plan uses styles {sorted({ep_plan[k] for k in odd})}; "
                                "grouped_gemm and ep_dispatch_experts are laid out")
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
        if style not in TP_STYLES or style == "colwise_fused_qkv":
            raise UnknownModelError(f"{name}: its TP plan gives {pattern!r} the style {style!r}, which is not "
                                    f"mapped here (mapped: {', '.join(s for s in TP_STYLES if s != 'colwise_fused_qkv')})")
        try:
            module = block.get_submodule(rel)
        except AttributeError:
            raise UnknownModelError(f"{name}: its TP plan names {pattern!r}, which a block does not have") from None
        if style != "replicated_with_grad_allreduce" and not isinstance(module, nn.Linear):
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


# ---- the small copy -------------------------------------------------------------------------------

def small_config(config: dict) -> dict:
    """`config` at a size the CPU builds in a blink, with the same code paths: its kv-head
    ratio, a block of each layer type, a window shorter than the check's sequence."""
    out = dict(config)
    heads = int(config.get("num_attention_heads", 1))
    kv = int(config.get("num_key_value_heads") or heads)
    out.update(SMALL, num_hidden_layers=2, num_key_value_heads=SMALL["num_attention_heads"] if kv == heads else 2)
    out.pop("tp_plan", None)
    types = config.get("layer_types")
    if types:
        kinds = list(dict.fromkeys(types))
        out["layer_types"] = (kinds * 2)[:2]
    if config.get("sliding_window"):
        out["sliding_window"] = 4
    if "max_window_layers" in out:
        out["max_window_layers"] = 2
    for key, small in (("moe_intermediate_size", 32), ("shared_expert_intermediate_size", 48)):
        if config.get(key):
            out[key] = small
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):  # enough experts for every ep the suite runs, few enough to build in a blink
            out[key] = min(int(config[key]), 8)
            out["num_experts_per_tok"] = min(int(config.get("num_experts_per_tok") or 1), out[key])
    return out


def checked(config: dict, name: str, facts: FamilyInfo) -> FamilyInfo:
    """`facts` completed and checked on the small copy: the norms' initial value and the
    embedding scale read there, then the stage forward (all blocks, embeddings and head)
    against the model's own logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from .stage import StageModule

    small = small_config(config)
    cfg = _config(small, f"{name} (small copy)")
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    except Exception as exc:  # noqa: BLE001
        raise UnknownModelError(f"{name}: a small copy of its config does not build ({type(exc).__name__}: "
                                f"{exc}), so its stage forward cannot be checked") from None
    sfacts = derive_unchecked(small, name)
    norm = model.get_submodule(sfacts.layers_path)[0].get_submodule(sfacts.norm_paths[0]) if sfacts.norm_paths \
        else None
    weight = getattr(norm, "weight", None)
    norm_init = float(weight.detach().flatten()[0]) if weight is not None else 1.0
    scale = _embedding_scale(model, small, sfacts)
    sspec = ModelSpec(name=name, family=cfg.model_type, config=small,
                      facts=dataclasses.replace(sfacts, embedding_scale=scale, norm_init=norm_init))
    ids = torch.randint(0, cfg.vocab_size, (2, CHECK_SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        got = StageModule(model, sspec, list(range(cfg.num_hidden_layers)), True, True)(ids)
    diff = float((want - got).abs().max())
    if not diff <= CHECK_TOL:
        raise UnknownModelError(
            f"{name}: the pipeline / context-parallel forward built from its facts does not give the model's "
            f"own logits on a small copy (max |difference| {diff:.3g} > {CHECK_TOL:g}): its forward does "
            "something around or between the blocks that the derived facts do not say")
    return dataclasses.replace(facts, embedding_scale=scale, norm_init=norm_init)


def _embedding_scale(model, config: dict, facts: FamilyInfo) -> str:
    """What the base model multiplies the embedding module's output by before the first block."""
    import torch
    ids = torch.arange(6).unsqueeze(0)
    seen = []
    hook = model.get_submodule(facts.layers_path)[0].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids)
            embedded = model.get_submodule(facts.embedding_path)(ids)
    finally:
        hook.remove()
    ratio = float(seen[0].norm() / embedded.norm())
    if math.isclose(ratio, 1.0, rel_tol=1e-5):
        return ""
    if math.isclose(ratio, config["hidden_size"] ** 0.5, rel_tol=1e-3):
        return "sqrt_hidden"
    for key in ("embedding_multiplier", "embedding_scale"):
        if config.get(key) and math.isclose(ratio, float(config[key]), rel_tol=1e-4):
            return key
    raise UnknownModelError(f"the base model multiplies the embeddings by {ratio:.4g} before the first block, "
                            "a factor its config does not name")
