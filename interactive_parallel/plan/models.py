"""Model specs: the facts about a transformers causal LM that planning needs.

Owns the preset registry (configs as plain dicts, built into transformers configs by the
runtime), the per-family tensor-parallel plan (module path pattern -> style name) and
where the decoder layers live (for pipeline splits). Pure Python: knows nothing of
torch or transformers objects; the runtime applies these plans, the model code is
never edited.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The package's tokenizer: printable ASCII plus 4 specials, padded to a multiple of 8
# so that any tp up to 8 divides the embedding and the LM head evenly.
VOCAB_SIZE = 128


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the planner knows about one model, independent of any weights."""

    name: str
    """Preset name, or a label for a config object / local directory."""
    family: str
    """'llama' or 'gpt2': selects the TP plan and the layer paths."""
    config: dict[str, Any]
    """Keyword arguments of the transformers config (model_type included)."""
    source: str | None = None
    """Local directory with weights to load, or None for random init."""
    description: str = ""
    """One line for menus."""

    @property
    def num_layers(self) -> int:
        return int(self.config.get("num_hidden_layers", self.config.get("n_layer", 0)))

    @property
    def num_heads(self) -> int:
        return int(self.config.get("num_attention_heads", self.config.get("n_head", 0)))

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.num_heads)

    @property
    def hidden_size(self) -> int:
        return int(self.config.get("hidden_size", self.config.get("n_embd", 0)))

    @property
    def intermediate_size(self) -> int:
        return int(self.config.get("intermediate_size") or self.config.get("n_inner") or 4 * self.hidden_size)

    @property
    def max_positions(self) -> int:
        return int(self.config.get("max_position_embeddings", self.config.get("n_positions", 0)))

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def tied_embeddings(self) -> bool:
        default = self.family == "gpt2"
        return bool(self.config.get("tie_word_embeddings", default))

    @property
    def family_info(self) -> "FamilyInfo":
        return FAMILIES[self.family]


@dataclass(frozen=True)
class FamilyInfo:
    """Where things live inside one transformers model family."""

    layers_path: str
    """Dotted path of the ModuleList of decoder blocks."""
    embed_paths: tuple[str, ...]
    """Modules run before the first block (owned by the first pipeline stage)."""
    head_paths: tuple[str, ...]
    """Modules run after the last block (owned by the last pipeline stage)."""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """Module path pattern ('*' = any layer index) -> ParallelStyle name."""
    attention_path: str = "self_attn"
    """Attention module inside a block (its head count is rewritten under TP)."""


FAMILIES: dict[str, FamilyInfo] = {
    "llama": FamilyInfo(
        layers_path="model.layers",
        embed_paths=("model.embed_tokens", "model.rotary_emb"),
        head_paths=("model.norm", "lm_head"),
        tp_plan={
            "model.layers.*.self_attn.q_proj": "colwise",
            "model.layers.*.self_attn.k_proj": "colwise",
            "model.layers.*.self_attn.v_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.gate_proj": "colwise",
            "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise",
        },
        attention_path="self_attn",
    ),
    "gpt2": FamilyInfo(
        layers_path="transformer.h",
        embed_paths=("transformer.wte", "transformer.wpe", "transformer.drop"),
        head_paths=("transformer.ln_f", "lm_head"),
        tp_plan={
            # c_attn is a fused q|k|v projection; the runtime splits it per head before sharding.
            "transformer.h.*.attn.c_attn": "colwise_fused_qkv",
            "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.mlp.c_fc": "colwise",
            "transformer.h.*.mlp.c_proj": "rowwise",
        },
        attention_path="attn",
    ),
}

_COMMON_LLAMA = dict(model_type="llama", vocab_size=VOCAB_SIZE, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0, attention_bias=False, rope_theta=10000.0)
_COMMON_GPT2 = dict(model_type="gpt2", vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

PRESETS: dict[str, ModelSpec] = {
    "tiny-llama": ModelSpec(
        name="tiny-llama", family="llama",
        config=dict(_COMMON_LLAMA, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256),
        description="Llama, 4 layers x 64 wide, 0.28 M parameters: a step takes milliseconds on a CPU",
    ),
    "small-llama": ModelSpec(
        name="small-llama", family="llama",
        config=dict(_COMMON_LLAMA, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512),
        description="Llama, 8 layers x 256 wide, 8.4 M parameters: memory and comms become visible",
    ),
    "tiny-gpt2": ModelSpec(
        name="tiny-gpt2", family="gpt2",
        config=dict(_COMMON_GPT2, n_embd=64, n_layer=4, n_head=4, n_positions=256, tie_word_embeddings=True),
        description="GPT-2, 4 layers x 64 wide, tied embeddings",
    ),
}


class UnknownModelError(ValueError):
    """A model name that is neither a preset nor a local directory."""


def spec_from_config_dict(config: dict[str, Any], *, name: str = "custom", source: str | None = None) -> ModelSpec:
    model_type = config.get("model_type", "")
    family = "gpt2" if model_type == "gpt2" else "llama" if model_type in ("llama", "mistral", "qwen2") else None
    if family is None:
        raise UnknownModelError(
            f"model_type {model_type!r} has no TP plan and layer map here; supported families: llama, gpt2")
    if "vocab_size" not in config:
        raise UnknownModelError(f"config for {name!r} has no vocab_size")
    return ModelSpec(name=name, family=family, config=dict(config), source=source)


def resolve_model(model: Any) -> ModelSpec:
    """A preset name, a local model directory, a config dict, or a transformers config object."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        return spec_from_config_dict(model)
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):
        return spec_from_config_dict(model.to_dict(), name=getattr(model, "name_or_path", "") or model.model_type)
    if isinstance(model, (str, Path)):
        key = str(model)
        if key in PRESETS:
            return PRESETS[key]
        path = Path(key).expanduser()
        if (path / "config.json").is_file():
            config = json.loads((path / "config.json").read_text())
            return spec_from_config_dict(config, name=path.name, source=str(path.resolve()))
        raise UnknownModelError(
            f"unknown model {key!r}: not a preset ({', '.join(PRESETS)}) and not a directory with a config.json")
    raise UnknownModelError(f"cannot make a model from {type(model).__name__}")
