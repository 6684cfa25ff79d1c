"""Derived family facts checked on a small copy of the config, built whole on the CPU.

Owns the small copy (`small_config`: a few heads, two blocks, a short window, few experts, the
same code paths) and `checked(config, name, facts)`: what only a real forward tells (the value
`_init_weights` gives a norm, what the base model's forward multiplies the embeddings by) read
there, then the stage forward the pipeline and context parallel run (runtime.model.stage,
driven by the facts) compared with the model's own logits. A family whose forward does
something the facts do not say is refused here, with the difference named, rather than trained
wrong. Knows nothing of how the facts were read (runtime.model.family_facts reads the small
copy's too), of caching, or of plans, meshes and ranks.
"""
from __future__ import annotations

import dataclasses
import math

from ...plan.models import FamilyInfo, ModelSpec, UnknownModelError
from .family_facts import built_config, derive_unchecked

CHECK_TOL = 1e-4
"""Largest |logit| difference the stage forward may show against the model's own on the small copy (fp32)."""
CHECK_SEQ = 12
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16, vocab_size=96)
"""The small copy's widths (its heads, kv heads and layer types follow the config's pattern)."""


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
    cfg = built_config(small, f"{name} (small copy)")
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

