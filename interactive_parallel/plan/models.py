"""Model specs: the facts about a transformers causal LM that planning needs.

Owns the preset registry (configs as plain dicts, built into transformers configs by the
runtime), the configs the package ships for planning real models (CONFIGS: JSON files in
interactive_parallel/configs, no weights: Llama-3-8B, Llama-3-70B, a Llama-3.1-405B shape,
Qwen3-32B, Gemma-3-27B's text model, Mistral-7B and GPT-2 XL, its dropout off as in the
presets), and `FamilyInfo`: everything that differs
between model families, as data: module paths (blocks, embeddings, positions, rotary, norms,
head, attention, MLP), each block linear's shape and TP style, Conv1D's transposed weights,
the fused q|k|v projection, how attention takes its input, the tied head, and what the
model's own forward does around its blocks (embedding scale, logit soft-cap, sliding
windows). A family's facts are derived from transformers itself (its config's TP and PP
plans and the model built on the meta device: runtime.families), and carried in the spec
(`ModelSpec.facts`); FAMILIES holds by hand only what transformers does not declare (GPT-2
ships no TP plan). Pure Python: knows nothing of torch or transformers objects; the
runtime and the estimator interpret these facts, the model code is never edited.
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
    """A FAMILIES key ('llama', 'gpt2'): where things live in the model and how TP splits it."""
    config: dict[str, Any]
    """Keyword arguments of the transformers config (model_type included)."""
    source: str | None = None
    """Local model directory (its weights loaded, or seeded when it holds none; its tokenizer
    used), or None for seeded weights and the package's tokenizer."""
    description: str = ""
    """One line for menus."""
    facts: "FamilyInfo | None" = None
    """The family's facts derived from transformers (runtime.families), for a model type FAMILIES
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
        """Its family facts must be derived (runtime.families.with_facts) before they are read."""
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
                                "transformers and were not yet: interactive_parallel.runtime.families.with_facts(spec)")


TP_STYLES: dict[str, str] = {
    "colwise": "output features split over tp; the input arrives whole, the output leaves sharded",
    "rowwise": "input features split over tp; the partial outputs are all-reduced, the bias is replicated",
    "colwise_fused_qkv": "colwise on a fused [q | k | v] projection whose output features are regrouped "
                         "per head first, so each tp rank holds the q, k and v of its own heads",
    "colwise_gather_output": "colwise, its output gathered whole again (a fused projection the model splits "
                             "by global widths, or one a full-width norm follows)",
    "rowwise_split_input": "rowwise on an input that arrives whole: each rank takes its own slice of it",
    "replicated_with_grad_allreduce": "a norm between a colwise and a rowwise linear, normalizing each head "
                                      "on its own: its weight whole on every rank, its gradient summed over tp",
}
"""The TP style names a family's tp_plan may use, and what each does to a linear. The names
are transformers' own (`base_model_tp_plan`), but for GPT-2's hand-written fused one."""
TP_ALIASES = {"colwise_rep": "colwise_gather_output", "rowwise_rep": "rowwise_split_input"}
"""transformers' other names for the same styles."""


@dataclass(frozen=True)
class Linear:
    """The shape of one linear of a decoder block, in widths a ModelSpec resolves (ModelSpec.width)."""

    in_width: str | int
    """'hidden', 'intermediate', 'q' (heads x head_dim), 'kv' (kv heads x head_dim), 'qkv', or a
    number of features."""
    out_width: str | int
    bias: bool | str = False
    """True, False, or the config key that switches the bias on (default off)."""


@dataclass(frozen=True, kw_only=True)
class ExpertsInfo:
    """The mixture-of-experts part of a decoder block, as transformers 5 lays it out: a sparse
    block (its `mlp`) holding a router and one module with every expert's weights stacked on
    dim 0 (`gate_up_proj` [experts, 2 x width, hidden], `down_proj` [experts, hidden, width]).
    Block level paths, as FamilyInfo's."""

    block_path: str
    """The sparse block (router, experts, any shared expert)."""
    router_path: str
    """The router: its forward returns (logits, top-k weights, top-k expert ids)."""
    experts_path: str
    """The module holding the stacked expert weights (expert parallelism splits its dim 0)."""
    expert_params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Leaf name -> the shape of ONE expert's slice (dim 0 dropped): the inventory's expert bytes."""
    expert_width: int = 0
    """Each expert's intermediate width (moe_intermediate_size, or intermediate_size)."""
    ep_plan: dict[str, str] = field(default_factory=dict)
    """The config's `base_model_ep_plan`, model level ('*' = any block index): transformers' own
    expert-parallel styles, which runtime.parallel.ep applies."""
    aux_loss_key: str = ""
    """A config key: the coefficient of the router's load-balancing loss, added to the loss when
    the config's `output_router_logits` is on ('' none)."""


@dataclass(frozen=True, kw_only=True)
class FamilyInfo:
    """Everything that differs between transformers model families, as data.

    The runtime (runtime/parallel/{pp,tp,cp}.py, runtime/parallelized.py) and the estimator
    (plan/estimate.py) interpret these fields and never branch on a family's name: a new
    family is one FAMILIES entry. Module paths are dotted paths from the causal LM (model
    level) or from one decoder block (block level), as named_modules() spells them.
    """

    model_types: tuple[str, ...]
    """transformers `model_type` values built as this family (spec_from_config_dict)."""
    layers_path: str
    """Model level: the ModuleList of decoder blocks."""
    embedding_path: str
    """Model level: the token embedding (tied to the LM head when the spec ties them)."""
    position_embedding_path: str | None = None
    """Model level: learned absolute positions added to the token embedding (GPT-2's wpe), or None."""
    embedding_dropout_path: str | None = None
    """Model level: dropout after the embeddings, or None."""
    rotary_path: str | None = None
    """Model level: the rotary table; when set, every block gets `position_ids` and
    `position_embeddings` (cos, sin) as keyword arguments, else only the hidden states."""
    final_norm_path: str
    """Model level: the norm after the last block."""
    lm_head_path: str = "lm_head"
    """Model level: the output projection to the vocabulary."""
    attention_path: str
    """Block level: the attention module (CP reroutes it; TP localizes its head bookkeeping)."""
    attention_input: str | None = None
    """How a block hands attention its hidden states: the keyword's name, or None (positional).
    Sequence parallelism gathers the sequence at that input."""
    mlp_path: str
    """Block level: the MLP (sequence parallelism gathers the sequence at its first input)."""
    norm_paths: tuple[str, ...]
    """Block level: the norms; sequence parallelism runs them on sequence shards."""
    norm_bias: bool = False
    """Whether the norms (block and final) have a bias next to their weight (LayerNorm vs RMSNorm)."""
    norm_saves: tuple[int, int] = (2, 1)
    """What one norm keeps for backward per token, in fp32: (hidden-wide tensors, scalars).
    RMSNorm: its input and the normalized input, and the reciprocal RMS; LayerNorm: its input,
    the mean and the reciprocal standard deviation (plan.activations reads it)."""
    mlp_saves: int = 4
    """Intermediate-wide tensors the MLP keeps for backward between its input linears and its
    output linear, the output linear's input included: gated SiLU keeps the gate output, its
    SiLU, the up output and their product (4); GPT-2's tanh GELU keeps its input, three
    intermediates of the formula and its output (5)."""
    linears: dict[str, Linear] = field(default_factory=dict)
    """Block level path -> shape of every linear in a block (the estimator's inventory)."""
    weights_transposed: bool = False
    """Linears store their weight (in, out) (transformers' Conv1D), not (out, in) like nn.Linear:
    TP shards the other weight dim."""
    local_head_attrs: tuple[str, ...] = ()
    """Attention attributes that hold global widths or head counts in its forward; TP divides
    them by tp. (Llama reshapes with -1 and needs none; GPT-2 splits c_attn by split_size.)"""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """Model level path pattern ('*' = any block index) -> TP style (a TP_STYLES name)."""
    tied_by_default: bool = False
    """Embedding and LM head share one weight unless the config says tie_word_embeddings."""
    scaled_init: tuple[str, ...] = ()
    """Block level linears whose weights the model's `_init_weights` draws with std / sqrt(2 x layers)
    (GPT-2's residual projections); the others use the config's initializer_range."""
    block_params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Block level parameters outside `linears` and `norm_paths` (Qwen3's per-head q/k norms),
    name -> shape; whole on every tp rank."""
    norm_init: float = 1.0
    """What the model's `_init_weights` fills a norm's weight with: 1, or 0 where the norm
    scales by (1 + weight) (Gemma)."""
    embedding_scale: str = ""
    """What the model's forward multiplies the token embeddings by before the first block: ''
    (nothing), 'sqrt_hidden' (Gemma's normalizer) or a config key holding the factor."""
    logit_softcap: str = ""
    """A config key: the forward caps the logits at cap * tanh(logits / cap) ('' none)."""
    logit_divisor: str = ""
    """A config key: the forward divides the logits by its value ('' none)."""
    layer_windows: tuple[int | None, ...] = ()
    """Per decoder block, the sliding window its attention sees (None: the whole causal past);
    empty: no block slides."""
    layer_types: tuple[str, ...] = ()
    """Per decoder block, the config's layer type, when the rotary table takes one (Gemma 3's
    local and global tables); empty: one table for all."""
    experts: ExpertsInfo | None = None
    """Its blocks' mixture of experts (every block sparse), or None for a dense MLP. Under tp
    the experts stay whole on every tp rank (attention is split); ep splits them."""

    @property
    def embed_paths(self) -> tuple[str, ...]:
        """Modules run before the first block (owned by the first pipeline stage)."""
        return tuple(p for p in (self.embedding_path, self.position_embedding_path, self.embedding_dropout_path,
                                 self.rotary_path) if p)

    @property
    def head_paths(self) -> tuple[str, ...]:
        """Modules run after the last block (owned by the last pipeline stage)."""
        return (self.final_norm_path, self.lm_head_path)

    def block_tp_styles(self) -> dict[str, str]:
        """Block level path -> TP style, from tp_plan's model level patterns."""
        prefix = f"{self.layers_path}.*."
        return {pattern[len(prefix):]: style for pattern, style in self.tp_plan.items()}


FAMILIES: dict[str, FamilyInfo] = {
    # Held by hand though transformers declares it: the presets' family, read by the pure tiers
    # (estimates, planner) without building a model. tests/test_any_model.py holds it equal to
    # what runtime.families derives from these model types.
    "llama": FamilyInfo(
        model_types=("llama",),
        layers_path="model.layers",
        embedding_path="model.embed_tokens",
        rotary_path="model.rotary_emb",
        final_norm_path="model.norm",
        attention_path="self_attn",
        attention_input="hidden_states",
        mlp_path="mlp",
        norm_paths=("input_layernorm", "post_attention_layernorm"),
        linears={
            "self_attn.q_proj": Linear("hidden", "q", "attention_bias"),
            "self_attn.k_proj": Linear("hidden", "kv", "attention_bias"),
            "self_attn.v_proj": Linear("hidden", "kv", "attention_bias"),
            "self_attn.o_proj": Linear("q", "hidden", "attention_bias"),
            "mlp.gate_proj": Linear("hidden", "intermediate", "mlp_bias"),
            "mlp.up_proj": Linear("hidden", "intermediate", "mlp_bias"),
            "mlp.down_proj": Linear("intermediate", "hidden", "mlp_bias"),
        },
        tp_plan={
            "model.layers.*.self_attn.q_proj": "colwise",
            "model.layers.*.self_attn.k_proj": "colwise",
            "model.layers.*.self_attn.v_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.gate_proj": "colwise",
            "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise",
        },
    ),
    "gpt2": FamilyInfo(
        model_types=("gpt2",),
        layers_path="transformer.h",
        embedding_path="transformer.wte",
        position_embedding_path="transformer.wpe",
        embedding_dropout_path="transformer.drop",
        final_norm_path="transformer.ln_f",
        attention_path="attn",
        mlp_path="mlp",
        norm_paths=("ln_1", "ln_2"),
        norm_bias=True,
        norm_saves=(1, 2),
        mlp_saves=5,
        linears={
            "attn.c_attn": Linear("hidden", "qkv", True),
            "attn.c_proj": Linear("hidden", "hidden", True),
            "mlp.c_fc": Linear("hidden", "intermediate", True),
            "mlp.c_proj": Linear("intermediate", "hidden", True),
        },
        weights_transposed=True,
        local_head_attrs=("split_size", "num_heads", "embed_dim"),
        tp_plan={
            "transformer.h.*.attn.c_attn": "colwise_fused_qkv",
            "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.mlp.c_fc": "colwise",
            "transformer.h.*.mlp.c_proj": "rowwise",
        },
        tied_by_default=True,
        scaled_init=("attn.c_proj", "mlp.c_proj"),
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
