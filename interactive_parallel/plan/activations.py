"""The activation model, per forward: the bytes one forward of one micro-batch saves for backward
on one rank, part by part.

Owns the count, tensor by tensor, of what autograd saves in a decoder block, the embedding
and the head of a transformers model as the runtime runs it, and how the plan scales it:
tensor parallel splits heads and intermediate features; sequence parallel runs the norms on
a sequence shard but gathers the whole sequence for the linears; context parallel keeps a
sequence shard except the gathered K and V (and the causal mask of the rank's queries);
bf16/fp16 autocast saves half-width copies of every linear's input (one per linear: the
autocast cache only holds leaf tensors) and of every linear weight (one per step), while norms,
softmax statistics and the loss stay fp32. Where FSDP gathers bf16 parameters
(Plan.gathers_bf16) the units compute in them: the residual stream is bf16, no copy is made of
a weight or of a linear's input (the norm's bf16 output is every input linear's), and a norm
saves what it computes in (an RMSNorm its fp32 upcast and statistics and its bf16 normalized
input, as Llama's multiplies it by the weight; a LayerNorm its bf16 input and statistics). Under
recomputation (the plan's `recompute`) a block keeps its input ('full') or its input and its
matmul, attention and collective outputs ('selective') until its backward, which first runs
the block again (kept_under_recompute, recomputed_in_backward). What differs between families
is data in plan.facts.FamilyInfo (norm_saves, mlp_saves, rotary_path, position_embedding_path,
the tp_plan's colwise linears; a mixture-of-experts block, ExpertsInfo: see moe_saves). When
these sets are live at once, and so the step's peak (pipeline schedules keep several
micro-batches in flight), is plan.activation_peak's.

"Activations" means what the memory probe measures (runtime/probes/memory.py): on CPU the
peak of live bytes saved for backward, parameters excluded, each storage counted once. So
the token ids count as the storage they are a view of (the global batch on CPU), and
temporaries that are never saved (attention scores of the fused kernel, all-gather
buffers, gradients in flight) are not counted. tests/test_activations.py holds this model
to the probe on every parity plan of the test suite (fp32 and bf16, every rank) within 10%;
under recomputation it counts high, because 'selective' frees some matmul outputs once its
block has run again, earlier than counted here. On CUDA the allocator's peak also sees
those temporaries, which this model does not know.

Not modelled: dropout with p > 0 (the presets and shipped configs train without it),
attention implementations other than SDPA, and MLP nonlinearities other than the two
families' (mlp_saves). Pure Python: knows no torch, nor any schedule's order.
"""
from __future__ import annotations

from dataclasses import dataclass

from .axes import MeshAxis, mesh_coords
from .inventory import Memo, local_tensors, spec_key
from .models import ModelSpec
from .plan import Plan

FP32, INT64 = 4, 8


def act_bytes(plan: Plan) -> int:
    """Bytes per element of what autocast computes in (matmul and attention outputs)."""
    return 2 if plan.precision in ("bf16", "fp16") else FP32


def stream_bytes(plan: Plan) -> int:
    """Bytes per element of the residual stream between blocks: fp32 but where FSDP gathers bf16
    parameters, whose units then compute in them."""
    return 2 if plan.gathers_bf16 else FP32


def norm_bytes(spec: ModelSpec, plan: Plan) -> int:
    """Bytes one norm saves per token of the stream (module docstring: in bf16 units, what it
    computes in)."""
    wide, scalars = spec.family_info.norm_saves
    h = spec.hidden_size
    if not plan.gathers_bf16:
        return (wide * h + scalars) * FP32
    if spec.family_info.norm_bias:  # LayerNorm: in its input's dtype
        return (wide * h + scalars) * stream_bytes(plan)
    return ((wide - 1) * h + scalars) * FP32 + h * stream_bytes(plan)


def micro_rows(plan: Plan) -> int:
    """Sequences in one forward on this rank: its batch share, per accumulation micro-step and
    pipeline microbatch."""
    rows = plan.batch_size // plan.data_parallel // plan.grad_accum
    return rows // plan.n_microbatches if plan.pp > 1 else rows


def _colwise(spec: ModelSpec, module: str) -> int:
    """How many input linears (colwise in the TP plan) read a block module's input."""
    prefix = f"{module}."
    return sum(1 for path, style in spec.family_info.block_tp_records().items()
               if path.startswith(prefix) and style.shards == "output")


@dataclass(frozen=True)
class Parts:
    """Bytes saved for backward by one forward of one micro-batch, by part of the model."""

    norms: int = 0
    linear_inputs: int = 0
    attention: int = 0
    mlp: int = 0
    embedding: int = 0
    head: int = 0

    @property
    def total(self) -> int:
        return self.norms + self.linear_inputs + self.attention + self.mlp + self.embedding + self.head

    def __add__(self, other: "Parts") -> "Parts":
        return Parts(*(a + b for a, b in zip(self._fields(), other._fields())))

    def scaled(self, k: int) -> "Parts":
        return Parts(*(a * k for a in self._fields()))

    def _fields(self) -> tuple[int, ...]:
        return (self.norms, self.linear_inputs, self.attention, self.mlp, self.embedding, self.head)


def layer_parts(spec: ModelSpec, plan: Plan, rows: int) -> Parts:
    """One decoder block, one micro-batch of `rows` sequences on this rank."""
    key = (spec_key(spec), rows, plan.tp, plan.cp, plan.cp_method, plan.seq_len, plan.sequence_parallel,
           plan.precision, plan.gathers_bf16, plan.loss_parallel, plan.ep)
    return _LAYER.get_or_make(key, lambda: _layer_parts(spec, plan, rows))


_LAYER = Memo(4096)


def stream_tokens(plan: Plan, tokens: int) -> int:
    """Tokens of the residual stream between blocks on this rank: the sequence shard under
    sequence parallelism, else all `tokens` of its micro-batch."""
    return tokens // plan.tp if plan.sequence_parallel and plan.tp > 1 else tokens


def _layer_parts(spec: ModelSpec, plan: Plan, rows: int) -> Parts:
    fam, a = spec.family_info, act_bytes(plan)
    h, q, kv, i = spec.hidden_size, spec.width("q"), spec.width("kv"), spec.intermediate_size
    seq = plan.seq_len
    tokens = rows * seq // plan.cp  # this rank's share of the sequence
    norms = len(fam.norm_paths) * stream_tokens(plan, tokens) * norm_bytes(spec, plan)
    # Under tp a module computes on its own heads or features only when its input linears leave
    # their outputs split; gathered ones (Phi-3's fused projections, OLMo 2's q/k/v) give every
    # rank the whole width.
    tp_attn, tp_mlp = _split(spec, plan, fam.attention_path), _split(spec, plan, fam.mlp_path)
    norms += tokens * _head_norm_saves(spec, tp_attn) * FP32
    # The input of the attention and of the MLP (whole sequence: SP gathers it): one tensor read
    # by every input linear; under autocast over fp32 parameters a cast copy for each of them.
    # (A mixture of experts: the router's linear is the MLP's one input linear.)
    mlp_inputs = 1 if fam.experts is not None else _colwise(spec, fam.mlp_path)
    copies = [1, 1] if a == stream_bytes(plan) else [_colwise(spec, fam.attention_path), mlp_inputs]
    inputs = sum(copies) * tokens * h * a
    # SDPA keeps q, k, v, its output and the log-sum-exp per head (fp32).
    attention = tokens * (2 * q // tp_attn * a + spec.num_heads // tp_attn * FP32)
    # Ring CP (runtime/parallel/ring.py) saves only the local K and V block, as without cp, and
    # its log-sum-exp (the same per-head fp32 as SDPA's); the blocks in transit are not kept.
    if plan.cp > 1 and plan.cp_method == "allgather":
        # whole-sequence K and V (GQA repeated first), and the causal mask of our queries
        kv_width = q if spec.num_kv_heads != spec.num_heads else kv
        attention += 2 * rows * seq * kv_width // tp_attn * a + (seq // plan.cp) * seq * a
    else:
        attention += tokens * 2 * kv // tp_attn * a
    attention += tokens * _fused_view(spec) // tp_attn * a
    mlp = fam.mlp_saves * tokens * i // tp_mlp * a if fam.experts is None else moe_saves(spec, plan, tokens)
    return Parts(norms=norms, linear_inputs=inputs, attention=attention, mlp=mlp)


def moe_saves(spec: ModelSpec, plan: Plan, tokens: int) -> int:
    """Bytes one mixture-of-experts block saves for one forward of `tokens` tokens on this rank
    (its input is counted with the linears' inputs), at uniform routing.

    The router (whole batch on every tp rank): its softmax's fp32 probabilities (tokens x
    experts) and the top-k ids (int64). The experts (transformers' grouped_mm forward, on the
    (token, slot) pairs sorted by expert): the sort's permutation, the gather index and the
    inverse permutation (int64 each), the per-expert offsets (int32), the gathered inputs
    (pairs x hidden), the gate|up output (2 x width), the activation and the product (width
    each), the routing weights and the down projection's output (the weights multiply it).
    All fp32: grouped_mm is not autocast, it computes in the fp32 weights' dtype; bf16 where FSDP
    gathers the experts in bf16 (Plan.gathers_bf16 without ep: under ep FSDP leaves them out).
    Under ep (transformers' AllToAllEP) the sender keeps the argsort of its pairs and their
    gather index, the combined outputs (pairs x hidden) and the top-k weights they are scaled
    by; under tp each tp rank sends its 1/tp slice of the tokens. The experts run top-1 on what
    they receive (as many pairs as sent at uniform load) with unit weights, which do not need
    the down output, and keep a mask of the padding rows (bool).
    Not counted: the renormalization of the top-k weights (Mixtral's, Qwen3-MoE's with
    norm_topk_prob), (k + 1) fp32 per token.
    """
    ex, k, n = spec.family_info.experts, spec.experts_per_token, spec.num_experts
    h, width = spec.hidden_size, ex.expert_width
    router = tokens * (n * FP32 + k * INT64)
    f = stream_bytes(plan) if plan.ep <= 1 else FP32
    per_pair = (h + 4 * width + 1) * f  # gathered input, gate|up, activation, product, weight
    if plan.ep <= 1:
        pairs = tokens * k
        return router + pairs * (3 * INT64 + per_pair + h * f) + n * 4
    sent = tokens // plan.tp * k
    received = sent
    sender = sent * (2 * INT64 + FP32 + h * FP32)
    return router + sender + received * (1 + 2 * INT64 + per_pair) + n // plan.ep * 4


def _split(spec: ModelSpec, plan: Plan, module: str) -> int:
    """tp, or 1 when an input linear of `module` gathers its output whole again."""
    styles = spec.family_info.block_tp_records()
    gathered = any(st.gathers_output for path, st in styles.items() if path.startswith(f"{module}."))
    return 1 if gathered else plan.tp


def _fused_view(spec: ModelSpec) -> int:
    """Extra elements per token SDPA's saved v holds when it is a view of a fused q|k|v output
    that reaches attention unregrouped (Phi-3's qkv_proj): the whole fused storage (q + 2 kv)
    stays alive where a v of its own would hold kv. GPT-2's regrouped c_attn (colwise_fused_qkv)
    is counted by its hand-tuned entry."""
    fam = spec.family_info
    styles = fam.block_tp_records()
    fused = spec.width("q") + 2 * spec.width("kv")
    for path, lin in fam.linears.items():
        style = styles.get(path)
        if (path.startswith(f"{fam.attention_path}.") and spec.width(lin.out_width) == fused
                and (style is None or style.gathers_output)):
            return spec.width("q") + spec.width("kv")
    return 0


def _head_norm_saves(spec: ModelSpec, tp: int) -> int:
    """Elements per token the norms inside attention keep (Qwen3 and Gemma 3 normalize each head
    of q and k, OLMo 2 the whole of them): the norm's input and output, and one statistic per
    head (or per token)."""
    fam = spec.family_info
    wide, scalars = fam.norm_saves
    out = 0
    for name, shape in fam.block_params.items():
        path = name.rsplit(".", 1)[0]
        if not (path.startswith(f"{fam.attention_path}.") and "norm" in path):
            continue
        which = "kv" if path.rsplit(".", 1)[-1].startswith("k") else "q"
        width = spec.width(which)
        groups = width // shape[0] if shape[0] else 1  # per head: heads; whole width: one
        out += (wide * width + scalars * groups) // tp
    return out


def _outputs(spec: ModelSpec, plan: Plan, module: str | None = None, colwise_only: bool = False) -> int:
    """Output elements per token of the block's linears on this rank (of those under `module`;
    of the input linears only): colwise ones split over tp, rowwise ones whole."""
    fam, tp = spec.family_info, plan.tp
    styles = fam.block_tp_records()
    out = 0
    for path, lin in fam.linears.items():
        style = styles.get(path)
        colwise = style is not None and style.shards == "output"
        split = style is not None and style.splits_output  # a gathered output is whole again
        if (module is None or path.startswith(f"{module}.")) and (colwise or not colwise_only):
            width = spec.width(lin.out_width)
            out += width // tp if split else width
    return out


def kept_under_recompute(spec: ModelSpec, plan: Plan, rows: int) -> Parts:
    """What one checkpointed decoder block keeps from its forward until its backward.

    'full': its input (the residual stream). 'selective' (runtime/parallel/ac.py saves the
    outputs of matmuls, attention and collectives): also every linear's output (under tp the
    rowwise ones after their all-reduce too) and SDPA's output and log-sum-exp.
    """
    a, tp, h = act_bytes(plan), plan.tp, spec.hidden_size
    tokens = rows * plan.seq_len // plan.cp
    stream = stream_tokens(plan, tokens)
    kept = Parts(linear_inputs=stream * h * stream_bytes(plan))
    if plan.recompute == "selective":
        rowwise = sum(1 for st in spec.family_info.block_tp_records().values() if st.reduces_output)
        reduced = rowwise * h * stream if tp > 1 else 0  # after the all-reduce (SP: reduce-scatter)
        # SP's all-gathers of the attention's and the MLP's input (the norm outputs) are
        # collectives too: their whole-sequence outputs are kept.
        gathered = 2 * tokens * h * stream_bytes(plan) if stream != tokens else 0
        kept = kept + Parts(linear_inputs=(tokens * _outputs(spec, plan) + reduced) * a + gathered,
                            attention=tokens * (spec.width("q") // tp * a + spec.num_heads // tp * FP32))
    return kept


def recomputed_in_backward(spec: ModelSpec, plan: Plan, rows: int, rank: int) -> Parts:
    """What a checkpointed block's forward, run again in its backward, adds to what the block kept:
    its whole saved set (layer_parts) but for what both hold (its input; under 'selective' SDPA's
    output and log-sum-exp, its k and v inputs (and q) where no rotary makes new ones, the MLP's
    input linears' outputs), and under autocast the copies of its weights."""
    fam, a, tp = spec.family_info, act_bytes(plan), plan.tp
    tokens = rows * plan.seq_len // plan.cp
    stream = stream_tokens(plan, tokens)
    whole = layer_parts(spec, plan, rows)
    norms, attention, mlp = whole.norms - stream * spec.hidden_size * _shared_input(spec, plan), whole.attention, whole.mlp
    if plan.recompute == "selective":
        q, kv = spec.width("q") // tp, spec.width("kv") // tp
        attention -= tokens * ((q + (kv if fam.rotary_path else q + 2 * kv)) * a + spec.num_heads // tp * FP32)
        mlp -= tokens * _outputs(spec, plan, fam.mlp_path, colwise_only=True) * a
    return Parts(norms=norms, linear_inputs=whole.linear_inputs + extra_weights(spec, plan, rank),
                 attention=attention, mlp=mlp)


def _shared_input(spec: ModelSpec, plan: Plan) -> int:
    """Bytes per element of the block's input that its first norm saves as it is (and a
    checkpoint keeps): fp32 residual streams, and bf16 ones into a LayerNorm; an RMSNorm in a
    bf16 unit saves its own fp32 upcast instead (norm_bytes)."""
    if not plan.gathers_bf16:
        return FP32
    return stream_bytes(plan) if spec.family_info.norm_bias else 0


def _layers_held(spec: ModelSpec, plan: Plan, rank: int) -> int:
    if plan.pp == 1:
        return spec.num_layers
    counts = plan.layer_counts(spec.num_layers)
    return sum(counts[s] for s in plan.stage_ids(mesh_coords(rank, plan.mesh_shape)[MeshAxis.PP]))


def once_per_forward(spec: ModelSpec, plan: Plan, rows: int, first: bool, last: bool) -> Parts:
    """What a forward of one micro-batch saves outside the blocks: rotary table, positions, head."""
    fam, a = spec.family_info, act_bytes(plan)
    seq = plan.seq_len // plan.cp
    tokens = rows * seq
    embedding = 0
    if fam.rotary_path:  # cos and sin, (1, 1, seq, head_dim), in the stream's dtype, shared by the blocks
        embedding += 2 * seq * spec.head_dim * stream_bytes(plan)
    if first and fam.position_embedding_path:  # the learned positions' indices, (1, seq)
        embedding += seq * INT64
    if first and plan.cp > 1:  # CP cuts each rank's ids out of the batch: a new tensor
        embedding += tokens * INT64
    head = 0
    if last:
        head = tokens * norm_bytes(spec, plan)  # final norm (whole sequence)
        head += tokens * spec.hidden_size * a  # the LM head's input
        # fp32 log-probabilities, the targets; under loss parallel each tp rank keeps its vocabulary
        # shard of them (torch's loss_parallel: measured 1/tp, the logits never gathered)
        vocab = spec.vocab_size // plan.tp if plan.loss_parallel and plan.tp > 1 else spec.vocab_size
        head += tokens * (vocab * FP32 + INT64)
        head += FP32  # the loss
    return Parts(embedding=embedding, head=head)


def once_per_step(spec: ModelSpec, plan: Plan, rank: int) -> int:
    """Saved once however many micro-batches run: the batch's token ids (first stage), and
    under autocast the half-width copy of every linear weight the rank multiplies by (none where
    FSDP gathers bf16 parameters: they are the weights multiplied)."""
    pp_rank = mesh_coords(rank, plan.mesh_shape)[MeshAxis.PP]
    stages = plan.stage_ids(pp_rank) if plan.pp > 1 else [0]
    out = 0
    if 0 in stages and plan.cp == 1:
        # The ids are a view of the global batch (runtime.training.train), whose whole storage counts;
        # on CUDA they are copied over: this rank's rows only.
        rows = plan.batch_size if plan.device == "cpu" else plan.batch_size // plan.data_parallel
        out += rows * (plan.seq_len + 1) * INT64
    if act_bytes(plan) != FP32 and not plan.gathers_bf16:
        last = plan.n_stages - 1 in stages or plan.pp == 1
        if plan.recompute == "none":
            out += weight_elements(spec, plan, rank, last=last) * act_bytes(plan)
        elif last:  # checkpointed blocks keep no weight copy from their forward; the head does
            out += (weight_elements(spec, plan, rank, last=True) - weight_elements(spec, plan, rank, last=False)) \
                * act_bytes(plan)
    return out


def weight_elements(spec: ModelSpec, plan: Plan, rank: int, last: bool) -> int:
    """Elements of the linear weights `rank` multiplies by: the TP shards of its blocks' linears
    and, on the last stage, of the LM head; whole over FSDP, which gathers a unit's weights
    before its forward (so the plan with fsdp folded into dp says what is multiplied: the
    rank numbers of the two plans coincide)."""
    fam = spec.family_info
    head = f"{fam.embedding_path if spec.tied_embeddings else fam.lm_head_path}.weight"
    leaves = {f"{path}.weight" for path in fam.linears}
    if fam.experts is not None:  # the router is a linear too (the experts' grouped_mm is not autocast)
        leaves.add(f"{fam.experts.router_path}.weight")
    gathered = plan.replace(dp=plan.dp * plan.fsdp, fsdp=1)
    total = 0
    for p, held, _ in local_tensors(spec, gathered, rank):
        in_block = p.owner == "layer" and p.name[len(f"{fam.layers_path}.{p.layer}."):] in leaves
        if in_block or (last and p.name == head):
            total += held
    return total


def stage_parts(spec: ModelSpec, plan: Plan, stage: int, rows: int) -> Parts:
    """One forward of one micro-batch through pipeline stage `stage` (the whole model without PP),
    as kept until its backward."""
    total = plan.n_stages if plan.pp > 1 else 1
    layers = plan.layer_counts(spec.num_layers)[stage]
    block = layer_parts(spec, plan, rows) if plan.recompute == "none" else kept_under_recompute(spec, plan, rows)
    return block.scaled(layers) + once_per_forward(spec, plan, rows, first=stage == 0, last=stage == total - 1)


def extra_weights(spec: ModelSpec, plan: Plan, rank: int) -> int:
    """Bytes of one block's weight copies in recomputed_in_backward (under autocast)."""
    if act_bytes(plan) == FP32 or plan.gathers_bf16:
        return 0
    return weight_elements(spec, plan, rank, last=False) // max(1, _layers_held(spec, plan, rank)) * act_bytes(plan)
