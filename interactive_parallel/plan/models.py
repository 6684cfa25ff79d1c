"""Model specs: the facts about a transformers causal LM that planning needs.

Owns the preset registry (configs as plain dicts, built into transformers configs by the
runtime), the configs the package ships for planning real models (CONFIGS: JSON files in
interactive_parallel/configs, no weights: Llama-3-8B, Llama-3-70B, a Llama-3.1-405B shape,
Qwen3-32B, Gemma-3-27B's text model, Mistral-7B and GPT-2 XL, its dropout off as in the
presets), and how a model is named (resolve_model: a preset, a shipped config, a config file
or dict, a local directory). A family's facts (plan.facts: module paths, every block linear's
shape and TP style, the experts, what the model's forward does around its blocks) are derived
from transformers itself (runtime.model.families) and carried in the spec (`ModelSpec.facts`);
plan.facts.FAMILIES holds by hand only what transformers does not declare. They are
re-exported here. Pure Python: knows nothing of torch or transformers objects; the
runtime and the estimator interpret these facts, the model code is never edited.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .facts import FAMILIES, ExpertsInfo, FamilyInfo, Linear
from .tp_styles import TP_ALIASES, TP_STYLES

__all__ = ["VOCAB_SIZE", "ModelSpec", "TP_STYLES", "TP_ALIASES", "Linear", "ExpertsInfo", "FamilyInfo", "FAMILIES",
           "PRESETS", "CONFIGS", "CONFIG_DIR", "UnknownModelError", "spec_from_config_dict", "resolve_model"]

# The package's tokenizer: printable ASCII plus 4 specials, padded to a multiple of 8
# so that any tp up to 8 divides the embedding and the LM head evenly.
VOCAB_SIZE = 128


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the planner knows about one model, independent of any weights."""

    name: str
    """Preset name, or a label for a config object / local directory."""
    family: str
    """A FAMILIES key ('llama', 'gpt2'): where things live in the model and how TP splits it."""
    config: dict[str, Any]
    """Keyword arguments of the transformers config (model_type included)."""
    source: str | None = None
    """Local model directory (its weights loaded, or seeded when it holds none; its tokenizer
    used), or None for seeded weights and the package's tokenizer."""
    description: str = ""
    """One line for menus."""
    facts: "FamilyInfo | None" = None
    """The family's facts derived from transformers (runtime.model.families), for a model type FAMILIES
    does not hold by hand; None until derived."""

    @property
    def has_weights(self) -> bool:
        """Whether `source` holds weight files: a directory with a config (and a tokenizer) alone is
        a shape, its weights seeded as for a config file."""
        if not self.source or not Path(self.source).is_dir():
            return False
        return any(p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")
                   for p in Path(self.source).iterdir())

    @property
    def needs_facts(self) -> bool:
        """Its family facts must be derived (runtime.model.families.with_facts) before they are read."""
        return self.facts is None and self.family not in FAMILIES

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
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.hidden_size // self.num_heads)

    def width(self, name: str | int) -> int:
        """A Linear's width by name: 'hidden', 'intermediate', 'q', 'kv' or 'qkv' (q + 2 kv);
        a number is itself (derived families give their linears' widths as numbers)."""
        if isinstance(name, int):
            return name
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        widths = {"hidden": self.hidden_size, "intermediate": self.intermediate_size, "q": q, "kv": kv,
                  "qkv": q + 2 * kv}
        return widths[name]

    @property
    def experts(self) -> "ExpertsInfo | None":
        """The mixture-of-experts facts of its blocks (None: a dense model)."""
        return self.family_info.experts

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model), under any of the names configs use."""
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            if self.config.get(key):
                return int(self.config[key])
        return 0

    @property
    def experts_per_token(self) -> int:
        """The router's top-k: experts each token goes to (0: a dense model)."""
        return int(self.config.get("num_experts_per_tok") or 0)

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", self.family_info.tied_by_default))

    @property
    def family_info(self) -> "FamilyInfo":
        if self.facts is not None:
            return self.facts
        if self.family in FAMILIES:
            return FAMILIES[self.family]
        raise UnknownModelError(f"the facts of model type {self.family!r} ({self.name}) are derived from "
                                "transformers and were not yet: interactive_parallel.runtime.model.families.with_facts(spec)")



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


CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIGS: dict[str, Path] = {p.stem: p for p in sorted(CONFIG_DIR.glob("*.json"))}
"""Shipped config name ('llama-3-70b') -> its JSON file: real models' shapes, for dry runs and estimates."""


class UnknownModelError(ValueError):
    """A model name that is neither a preset, a shipped config, a config file nor a local directory."""


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnknownModelError(f"cannot read config file {str(path)!r}: {e}") from None
    if not isinstance(config, dict):
        raise UnknownModelError(f"config file {str(path)!r} holds a {type(config).__name__}, not a JSON object")
    return config


def spec_from_config_dict(config: dict[str, Any], *, name: str = "custom", source: str | None = None) -> ModelSpec:
    """A spec of `config`; a model type without a FAMILIES entry has its family facts derived
    from transformers when first needed (ModelSpec.needs_facts)."""
    model_type = config.get("model_type", "")
    if not isinstance(model_type, str) or not model_type:
        raise UnknownModelError(f"config for {name!r} has no model_type")
    family = next((name for name, info in FAMILIES.items() if model_type in info.model_types), model_type)
    if "vocab_size" not in config:
        raise UnknownModelError(f"config for {name!r} has no vocab_size")
    return ModelSpec(name=name, family=family, config=dict(config), source=source)


def resolve_model(model: Any) -> ModelSpec:
    """A preset name, a shipped config name (CONFIGS), a config JSON file, a local model directory,
    a config dict, or a transformers config object."""
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
        if key in CONFIGS:
            return spec_from_config_dict(_read_config(CONFIGS[key]), name=key)
        path = Path(key).expanduser()
        if (path / "config.json").is_file():
            return spec_from_config_dict(_read_config(path / "config.json"), name=path.name, source=str(path.resolve()))
        if path.is_file():  # a config file alone: the shape, no weights
            return spec_from_config_dict(_read_config(path), name=path.stem)
        raise UnknownModelError(
            f"unknown model {key!r}: not a preset ({', '.join(PRESETS)}), not a shipped config "
            f"({', '.join(CONFIGS)}), not a config file and not a directory with a config.json")
    raise UnknownModelError(f"cannot make a model from {type(model).__name__}")
