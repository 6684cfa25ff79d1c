"""A model family's facts: everything that differs between transformers model families, as data.

Owns `FamilyInfo` and its parts (`Linear`, a block linear's shape; `ExpertsInfo`, a mixture of
experts' router and stacked experts) and FAMILIES: the families held by hand (Llama, for the
torch-free tiers, and GPT-2, whose config ships no TP plan); every other family's facts are derived
from transformers by runtime.model.families and carried in its spec (plan.models.ModelSpec.facts). Pure
Python: knows nothing of torch or transformers objects; the runtime and the estimator interpret
these facts, the model code is never edited. What a TP style does is its record's
(plan.tp_styles); a family names its styles only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .tp_styles import TpStyle, tp_style


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

    The runtime (runtime/parallel/{pp,tp,cp}.py, runtime/layout/parallelized.py) and the estimator
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
    """Model level path pattern ('*' = any block index) -> TP style (a plan.tp_styles.TP_STYLES name)."""
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

    def block_tp_records(self) -> dict[str, TpStyle]:
        """Block level path -> the record of its TP style (plan.tp_styles; ValueError for a name no record has)."""
        return {path: tp_style(style) for path, style in self.block_tp_styles().items()}


FAMILIES: dict[str, FamilyInfo] = {
    # Held by hand though transformers declares it: the presets' family, read by the pure tiers
    # (estimates, planner) without building a model. tests/test_any_model.py holds it equal to
    # what runtime.model.families derives from these model types.
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
