"""Pipeline parallel: the decoder layers split into stages, run by torch.distributed.pipelining.

Owns the split of the model into the stages a rank holds (each a runtime.model.stage module
over the transformers model's own embeddings, layers and head; loop order: rank r holds
stages r, r + pp, ...; under a V, r and 2 * pp - 1 - r; Plan.stage_ids, from the schedule's
record), the schedule (torch's class, named by the plan's schedule record in plan.schedules:
GPipe, 1F1B, Interleaved1F1B, and the zero-bubble InterleavedZeroBubble, ZBVZeroBubble,
DualPipeV) with the last stage's loss (scaled for fp16), and a schedule-free forward
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
from ..model.loss import token_loss
from ..model.stage import StageModule


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
    the schedule's step, backward included, runs inside runtime.model.loss.loss_context.
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
    Token ids arrive as `batch[:, :-1]` of a (rows, seq + 1) batch (runtime.training.train), hence the
    stride; hidden states and their gradients are fp32 under autocast (the residual stream is),
    bf16 where FSDP gathers bf16 parameters (Plan.gathers_bf16: the stages compute in them);
    the last stage's logits take the autocast dtype.
    """
    rows = plan.batch_size // (plan.data_parallel * plan.grad_accum * plan.n_microbatches)
    seq = plan.seq_len
    stream = torch.bfloat16 if plan.gathers_bf16 else torch.float32
    with torch.device("meta"):
        if module.first:
            inp = torch.empty(rows, seq + 1, dtype=torch.long)[:, :-1]  # [mb, s], stride (s + 1, 1)
        else:
            inp = torch.empty(rows, seq, module.hidden_size, dtype=stream, requires_grad=True)  # [mb, s, h]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision, torch.float32)
        width, dtype = (module.vocab_size, dtype) if module.last else (module.hidden_size, stream)
        out = torch.empty(rows, seq, width, dtype=dtype, requires_grad=True)  # [mb, s, h or vocab]
    return inp, out


def apply_schedule(stage_modules: list[nn.Module], plan: Plan, pp_group, device) -> tuple[Any, tuple]:
    """(the plan's schedule over a PipelineStage per module, the schedule_shape it was built for).

    The class is torch's, chosen by the schedule record's torch name (plan.schedules, through
    get_schedule_class): a 'single' placement (GPipe, 1F1B) takes the rank's one stage, the
    multi-stage ones (looped, V) a list of them.
    scale_grads=False: pipeline_loss already divides by the microbatch (and accumulation)
    count. The schedule's own scaling divides *every* gradient after each step, which
    would also shrink what earlier accumulation micro-steps left there.
    On gloo the schedules' batched p2p (batch_isend_irecv) ran without hangs for GPipe,
    1F1B and Interleaved1F1B at pp 2 and 4, and for InterleavedZeroBubble, ZBVZeroBubble
    and DualPipeV (its overlapped F/B runs as its two halves in turn) at pp 2 and 4, with
    TP, DP and FSDP inside (measured here). Under every schedule FSDP keeps the stages
    gathered from the first forward to the last backward (runtime.layout.parallelize says why).
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    schedule = plan.schedule
    cls = get_schedule_class(schedule.torch_name)
    pp_rank = dist.get_rank(pp_group)
    stages = []
    for m, s in zip(stage_modules, plan.stage_ids(pp_rank)):
        inp, out = stage_examples(m, plan)
        stages.append(PipelineStage(m, s, plan.n_stages, device, input_args=inp, output_args=out, group=pp_group))
    kw = dict(n_microbatches=plan.n_microbatches, loss_fn=pipeline_loss(plan), scale_grads=False)
    held = stages[0] if schedule.placement == "single" else stages
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
