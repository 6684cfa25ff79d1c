"""Pipeline parallel: the decoder layers split into stages, run by torch.distributed.pipelining.

Owns the stage module (a thin nn.Module over the transformers model's own embeddings,
layers and head, found through the family's FAMILIES entry: the model code is not edited
and the parameter names stay the model's), the split into the stages a rank holds (loop
order: rank r holds stages r, r + pp, ...; under a V, r and 2 * pp - 1 - r; Plan.stage_ids),
the schedule (torch's class by name: GPipe, 1F1B, Interleaved1F1B, and the zero-bubble
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) with the last stage's loss (scaled for
fp16), and a schedule-free forward
for inference (shapes change every generated token, which a PipelineStage cannot follow):
micro-batches flow through the stages with point-to-point sends, each stage keeping the KV
cache of its own layers (transformers' cache classes) per micro-batch. Knows nothing of the
other axes: they are applied to the stage modules afterwards.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...plan import ModelSpec, Plan
from ..loss import token_loss


def causal_mask(attention_mask: torch.Tensor | None, seq: int, dtype, device, past: int = 0,
                window: int | None = None) -> torch.Tensor | None:
    """Additive (batch, 1, seq, past + seq) mask: causal (query i sees keys up to past + i, and
    with a sliding `window` only the last `window` of them, itself included) and hiding padding;
    None means plain causal over the queries alone (no cache, no padding, no window).

    Additive with the dtype's minimum, not -inf: a padding query that may see nothing then
    gets a uniform (finite) row instead of NaN, which would reach the real rows through V.
    """
    slides = window is not None and past + seq > window
    if past == 0 and not slides and (attention_mask is None or bool(attention_mask.all())):
        return None
    keep = torch.ones(seq, past + seq, dtype=torch.bool, device=device).tril(past)  # [s, past + s]
    if slides:
        keep &= ~torch.ones_like(keep).tril(past - window)  # keys at least `window` behind the query
    if attention_mask is not None:
        keep = keep[None, None] & attention_mask[:, None, None, :].bool()  # [b, 1, s, past + s]
    else:
        keep = keep[None, None]
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)


class StageModule(nn.Module):
    """Embeddings (first stage) -> some decoder layers -> norm and LM head (last stage).

    Holds the transformers model's own submodules, found through the family's entry in
    plan.models.FAMILIES, so their parameters keep their names relative to the model
    (`owned_prefixes` lists them). With first and last set and all layers it is the whole
    model, which context parallel uses as its forward.
    """

    def __init__(self, raw: nn.Module, spec: ModelSpec, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        fam = spec.family_info

        def part(path: str | None, held: bool = True) -> nn.Module | None:
            return raw.get_submodule(path) if path and held else None

        self.first, self.last = first, last
        self.stage_index = 0  # the global stage (apply_pp sets it); 0 for the whole model
        self.hidden_size, self.vocab_size = spec.hidden_size, spec.vocab_size
        self.embedding_scale = (spec.hidden_size ** 0.5 if fam.embedding_scale == "sqrt_hidden"
                                else float(spec.config[fam.embedding_scale]) if fam.embedding_scale else None)
        self.logit_softcap = float(spec.config[fam.logit_softcap]) if fam.logit_softcap else None
        self.logit_divisor = float(spec.config[fam.logit_divisor]) if fam.logit_divisor else None
        self.windows = [fam.layer_windows[i] if fam.layer_windows else None for i in layer_ids]
        self.rotary_types = [fam.layer_types[i] for i in layer_ids] if fam.layer_types else []
        self.layer_ids = list(layer_ids)
        all_layers = raw.get_submodule(fam.layers_path)
        self.layers = nn.ModuleList([all_layers[i] for i in layer_ids])
        self.embed = part(fam.embedding_path, first)
        self.pos_embed = part(fam.position_embedding_path, first)
        self.embed_drop = part(fam.embedding_dropout_path, first)
        # A rotary table is a constant buffer every stage needs; it is cheap to share.
        self.rotary = part(fam.rotary_path)
        self.norm = part(fam.final_norm_path, last)
        self.head = part(fam.lm_head_path, last)
        self.owned_prefixes = [f"{fam.layers_path}.{i}." for i in layer_ids]
        self.owned_prefixes += [p + "." for p in fam.embed_paths] if first else []
        self.owned_prefixes += [p + "." for p in fam.head_paths] if last else []

    def _embed(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # [b, s] -> [b, s, h]
        if self.embedding_scale is not None:
            # In the embeddings' dtype, as the model's forward does (Gemma's normalizer)
            h = h * torch.tensor(self.embedding_scale, dtype=h.dtype)
        if self.pos_embed is not None:
            h = h + self.pos_embed(position_ids)  # [1 or b, s, h] broadcast over the batch
        return self.embed_drop(h) if self.embed_drop is not None else h

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(h))  # [b, s, h] -> [b, s, vocab]
        if self.logit_divisor is not None:
            logits = logits / self.logit_divisor
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """`cache`: a transformers Cache holding (at least) this stage's layers, by their global
        index; `attention_mask` then covers the cached tokens too, [b, past + s]."""
        seq = x.shape[1]
        past = cache.get_seq_length(self.layer_ids[0]) if cache is not None else 0
        if position_ids is None:
            position_ids = (past + torch.arange(seq, device=x.device)).unsqueeze(0)  # [1, s]
        h = self._embed(x, position_ids) if self.first else x  # [b, s, h]
        masks = {w: causal_mask(attention_mask, seq, h.dtype, h.device, past, w)  # None or [b, 1, s, past + s]
                 for w in set(self.windows)}
        kw = {} if cache is None else dict(cache=cache)
        tables: dict = {}
        if self.rotary is not None:
            kw.update(position_ids=position_ids)
            for kind in set(self.rotary_types) or [None]:  # one table, or one per layer type (Gemma 3)
                extra = {} if kind is None else dict(layer_type=kind)
                tables[kind] = self.rotary(h, position_ids=position_ids, **extra)
        for i, layer in enumerate(self.layers):
            if tables:
                kw["position_embeddings"] = tables[self.rotary_types[i] if self.rotary_types else None]
            h = layer(h, attention_mask=masks[self.windows[i]], **kw)  # [b, s, h]
        if self.last:
            h = self._head(h)  # [b, s, h] -> [b, s, vocab]
        return h


def apply_pp(raw: nn.Module, spec: ModelSpec, plan: Plan, pp_rank: int) -> list[StageModule]:
    """The stage modules of this pipeline rank, each with its global `stage_index`; the layers of
    each stage as Plan.layer_counts gives them (even, or the plan's stage_layers)."""
    total = plan.n_stages
    modules = []
    for s in plan.stage_ids(pp_rank):
        module = StageModule(raw, spec, plan.stage_layer_ids(spec.num_layers, s), s == 0, s == total - 1)
        module.stage_index = s
        modules.append(module)
    return modules


_SCALER: list = [None]


@contextlib.contextmanager
def scaled_loss(scaler):
    """Within: pipeline_loss multiplies the loss by `scaler`'s scale (fp16; None: no scaling).
    The schedule calls backward on what the loss function returns, so scaling goes there."""
    _SCALER[0] = scaler
    try:
        yield
    finally:
        _SCALER[0] = None


def pipeline_loss(plan: Plan):
    """The last stage's loss per microbatch, already divided for the mean over the step, and
    scaled inside `scaled_loss(scaler)`.

    The schedule runs with scale_grads=False: its own division rescales *all* gradients,
    accumulated ones from earlier accumulation micro-steps included. Under loss parallel the
    logits arrive split on the vocabulary (a DTensor) and token_loss takes them as they are:
    the schedule's step, backward included, runs inside runtime.loss.loss_context.
    """
    parts = plan.n_microbatches * plan.grad_accum

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = token_loss(logits, targets) / parts
        scaler = _SCALER[0]
        return scaler.scale(loss) if scaler is not None else loss

    return loss_fn


def schedule_shape(plan: Plan) -> tuple:
    """The plan knobs a schedule fixes at its first step: rows per micro-step, seq_len, microbatches,
    accumulation. A PipelineStage keeps its first buffer shapes; other shapes abort gloo (measured)."""
    return (plan.batch_size // (plan.data_parallel * plan.grad_accum), plan.seq_len, plan.n_microbatches,
            plan.grad_accum)


def stage_examples(module: StageModule, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """What a stage takes and gives per microbatch, as meta tensors (shapes, strides, dtypes only).

    Given to PipelineStage, they spare the schedule its shape inference on the first step: a
    forward of the first microbatch whose saved tensors (they raise the first stage's
    activation peak) and metadata messages a dry run's fake group cannot carry.
    Token ids arrive as `batch[:, :-1]` of a (rows, seq + 1) batch (runtime.train), hence the
    stride; hidden states and their gradients are fp32 under autocast (the residual stream is);
    the last stage's logits take the autocast dtype.
    """
    rows = plan.batch_size // (plan.data_parallel * plan.grad_accum * plan.n_microbatches)
    seq = plan.seq_len
    with torch.device("meta"):
        if module.first:
            inp = torch.empty(rows, seq + 1, dtype=torch.long)[:, :-1]  # [mb, s], stride (s + 1, 1)
        else:
            inp = torch.empty(rows, seq, module.hidden_size, requires_grad=True)  # [mb, s, h]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision, torch.float32)
        width, dtype = (module.vocab_size, dtype) if module.last else (module.hidden_size, torch.float32)
        out = torch.empty(rows, seq, width, dtype=dtype, requires_grad=True)  # [mb, s, h or vocab]
    return inp, out


def apply_schedule(stage_modules: list[nn.Module], plan: Plan, pp_group, device) -> tuple[Any, tuple]:
    """(the plan's schedule over a PipelineStage per module, the schedule_shape it was built for).

    The class is torch's, chosen by name (plan.TORCH_SCHEDULES through get_schedule_class):
    GPipe and 1F1B take the rank's one stage, the multi-stage ones (looped, V) a list of them.
    scale_grads=False: pipeline_loss already divides by the microbatch (and accumulation)
    count. The schedule's own scaling divides *every* gradient after each step, which
    would also shrink what earlier accumulation micro-steps left there.
    On gloo the schedules' batched p2p (batch_isend_irecv) ran without hangs for GPipe,
    1F1B and Interleaved1F1B at pp 2 and 4, and for InterleavedZeroBubble, ZBVZeroBubble
    and DualPipeV (its overlapped F/B runs as its two halves in turn) at pp 2 and 4, with
    TP, DP and FSDP inside (measured here). Under a zero-bubble schedule FSDP keeps the
    stages unsharded between forward and backward (runtime.parallelize says why).
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from ...plan.plan import TORCH_SCHEDULES

    cls = get_schedule_class(TORCH_SCHEDULES[plan.pp_schedule])
    pp_rank = dist.get_rank(pp_group)
    stages = []
    for m, s in zip(stage_modules, plan.stage_ids(pp_rank)):
        inp, out = stage_examples(m, plan)
        stages.append(PipelineStage(m, s, plan.n_stages, device, input_args=inp, output_args=out, group=pp_group))
    kw = dict(n_microbatches=plan.n_microbatches, loss_fn=pipeline_loss(plan), scale_grads=False)
    held = stages[0] if issubclass(cls, PipelineScheduleSingle) else stages
    return cls(held, **kw), schedule_shape(plan)


def row_slices(rows: int, parts: int) -> list[slice]:
    """The rows of each micro-batch, as torch.tensor_split cuts them (the first rows % parts get one more)."""
    size, more = divmod(rows, parts)
    edges = [0]
    for m in range(parts):
        edges.append(edges[-1] + size + (m < more))
    return [slice(a, b) for a, b in zip(edges, edges[1:])]


@torch.no_grad()
def pipeline_forward(stage_modules: list[StageModule], plan: Plan, pp_group, ids: torch.Tensor,
                     hidden_size: int, vocab: int, *, caches: list | None = None, take: int | None = None,
                     attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of a forward through all stages, on every pp rank: [b, s, vocab], or [b, vocab]
    of position `take` alone.

    No PipelineStage: stages there fix their buffer shapes at first use, and reusing one
    with another sequence length aborts the process on gloo (measured). Every rank knows
    `ids`, so each can size its receive buffers. With `caches` (one transformers Cache per
    micro-batch) the rows are cut into len(caches) micro-batches that flow through the
    stages: a stage sends one micro-batch on (isend) and starts the next while the next
    stage works on the first, and each stage's layers keep their keys and values in that
    micro-batch's cache. Every rank walks (micro-batch, stage) in the same order, so the
    sends between two ranks meet their receives in order. A stage's rank is plan.stage_owner's:
    under a V (zbv, dualpipev) the hidden states go back down to lower ranks, and the two
    stages at the V's tip sit on one rank, which hands them on without a send. The last
    stage broadcasts the logits over the pp group, so every rank samples the same next token.
    """
    pp_rank, owner = dist.get_rank(pp_group), plan.stage_owner
    mine = dict(zip(plan.stage_ids(pp_rank), stage_modules))
    total = plan.n_stages
    parts = len(caches) if caches else 1
    last_owner = owner(total - 1)
    outs, pending = [], []
    for m, rows in enumerate(row_slices(ids.shape[0], parts)):
        mb = ids[rows]  # [b/m, s]
        kw = dict(cache=caches[m] if caches else None,
                  attention_mask=None if attention_mask is None else attention_mask[rows],
                  position_ids=position_ids if position_ids is None or position_ids.shape[0] == 1
                  else position_ids[rows])
        h = None
        for stage in range(total):
            if owner(stage) != pp_rank:
                continue
            if stage > 0 and owner(stage - 1) != pp_rank:
                h = torch.empty(mb.shape[0], mb.shape[1], hidden_size, device=ids.device)  # [b/m, s, h]
                dist.recv(h, group=pp_group, group_src=owner(stage - 1), tag=stage)
            h = mine[stage](mb if stage == 0 else h, **kw)  # [b/m, s, h], or [b/m, s, vocab] on the last stage
            if stage < total - 1:
                h = h.float().contiguous()  # what a receiving stage's fp32 buffer would hold
                if owner(stage + 1) != pp_rank:
                    pending.append(dist.isend(h, group=pp_group, group_dst=owner(stage + 1), tag=stage + 1))
        if pp_rank == last_owner:
            outs.append(h.float() if take is None else h[:, take].float())
    for work in pending:
        work.wait()
    b, s = ids.shape
    shape = (b, s, vocab) if take is None else (b, vocab)
    logits = torch.cat(outs).contiguous() if pp_rank == last_owner else torch.empty(shape, device=ids.device)
    dist.broadcast(logits, group=pp_group, group_src=last_owner)
    return logits
