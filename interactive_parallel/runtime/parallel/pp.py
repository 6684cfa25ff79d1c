"""Pipeline parallel: the decoder layers split into stages, run by torch.distributed.pipelining.

Owns the stage module (a thin nn.Module over the transformers model's own embeddings,
layers and head: the model code is not edited and the parameter names stay the model's),
which stages a rank holds (loop order: rank r holds stages r, r + pp, ...), the schedule
(GPipe, 1F1B, Interleaved1F1B) and a schedule-free forward with plain send/recv for
inference, whose shapes change every generated token. Knows nothing of the other axes:
they are applied to the stage modules afterwards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...plan import ModelSpec, Plan


def causal_mask(attention_mask: torch.Tensor | None, seq: int, dtype, device) -> torch.Tensor | None:
    """Additive (batch, 1, seq, seq) mask: causal and hiding padding; None means plain causal."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    keep = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    keep = keep[None, None] & attention_mask[:, None, None, :].bool()
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)


class StageModule(nn.Module):
    """Embeddings (first stage) -> some decoder layers -> norm and LM head (last stage).

    Holds the transformers model's own submodules, so their parameters keep their names
    relative to the model (`owned_prefixes` lists them). With first and last set and all
    layers it is the whole model, which context parallel uses as its forward.
    """

    def __init__(self, raw: nn.Module, spec: ModelSpec, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        fam = spec.family_info
        self.family, self.first, self.last = spec.family, first, last
        self.layer_ids = list(layer_ids)
        all_layers = raw.get_submodule(fam.layers_path)
        self.layers = nn.ModuleList([all_layers[i] for i in layer_ids])
        self.embeds = nn.ModuleList([raw.get_submodule(p) for p in fam.embed_paths]) if first else None
        self.heads = nn.ModuleList([raw.get_submodule(p) for p in fam.head_paths]) if last else None
        # Llama's rotary table is a constant buffer every stage needs; it is cheap to share.
        self.rotary = raw.get_submodule("model.rotary_emb") if spec.family == "llama" else None
        self.owned_prefixes = [f"{fam.layers_path}.{i}." for i in layer_ids]
        self.owned_prefixes += [p + "." for p in fam.embed_paths] if first else []
        self.owned_prefixes += [p + "." for p in fam.head_paths] if last else []

    def _embed(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.family == "llama":
            return self.embeds[0](ids)
        wte, wpe, drop = self.embeds
        return drop(wte(ids) + wpe(position_ids))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        seq = x.shape[1]
        if position_ids is None:
            position_ids = torch.arange(seq, device=x.device).unsqueeze(0)
        h = self._embed(x, position_ids) if self.first else x
        mask = causal_mask(attention_mask, seq, h.dtype, h.device)
        kw = {}
        if self.rotary is not None:
            kw = dict(position_ids=position_ids, position_embeddings=self.rotary(h, position_ids=position_ids))
        for layer in self.layers:
            h = layer(h, attention_mask=mask, **kw)
        if self.last:
            norm, head = self.heads
            h = head(norm(h))
        return h


def stage_ids(plan: Plan, pp_rank: int) -> list[int]:
    """Global stage indices held by pipeline rank `pp_rank` (loop order)."""
    v = plan.virtual_stages if plan.pp_schedule == "interleaved-1f1b" else 1
    return [pp_rank + k * plan.pp for k in range(v)]


def n_stages(plan: Plan) -> int:
    return plan.pp * (plan.virtual_stages if plan.pp_schedule == "interleaved-1f1b" else 1)


def split_stages(raw: nn.Module, spec: ModelSpec, plan: Plan, pp_rank: int) -> list[StageModule]:
    """The stage modules of this pipeline rank; layers split evenly (validation checks divisibility)."""
    total = n_stages(plan)
    per = spec.num_layers // total
    return [StageModule(raw, spec, list(range(s * per, (s + 1) * per)), s == 0, s == total - 1)
            for s in stage_ids(plan, pp_rank)]


def build_schedule(stage_modules: list[nn.Module], plan: Plan, pp_group, device, loss_fn):
    """PipelineStage per module and the plan's schedule over them.

    scale_grads=False: `loss_fn` already divides by the microbatch (and accumulation)
    count. The schedule's own scaling divides *every* gradient after each step, which
    would also shrink what earlier accumulation micro-steps left there.
    On gloo the schedules' batched p2p (batch_isend_irecv) ran without hangs for GPipe,
    1F1B and Interleaved1F1B at pp 2 and 4, with TP, DP and FSDP inside (measured here).
    """
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    pp_rank = dist.get_rank(pp_group)
    stages = [PipelineStage(m, s, n_stages(plan), device, group=pp_group)
              for m, s in zip(stage_modules, stage_ids(plan, pp_rank))]
    kw = dict(n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if plan.pp_schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(stages, **kw), stages
    cls = ScheduleGPipe if plan.pp_schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], **kw), stages


@torch.no_grad()
def pipeline_forward(stage_modules: list[StageModule], plan: Plan, pp_group, ids: torch.Tensor,
                     hidden_size: int, vocab: int, **kw) -> torch.Tensor:
    """Logits of a full forward through all stages with blocking send/recv, on every pp rank.

    No PipelineStage: stages there fix their buffer shapes at first use, and reusing one
    with another sequence length aborts the process on gloo (measured). Every rank knows
    `ids`, so each can size its receive buffer; the last stage broadcasts the logits.
    """
    pp_rank, pp = dist.get_rank(pp_group), plan.pp
    mine = dict(zip(stage_ids(plan, pp_rank), stage_modules))
    total = n_stages(plan)
    b, s = ids.shape
    h = None
    for stage in range(total):
        owner = stage % pp
        if owner != pp_rank:
            continue
        if stage > 0:
            h = torch.empty(b, s, hidden_size, device=ids.device)
            dist.recv(h, group=pp_group, group_src=(stage - 1) % pp)
        h = mine[stage](ids if stage == 0 else h, **kw)
        if stage < total - 1:
            dist.send(h.float().contiguous(), group=pp_group, group_dst=(stage + 1) % pp)
    logits = h.float().contiguous() if pp_rank == (total - 1) % pp else torch.empty(b, s, vocab, device=ids.device)
    dist.broadcast(logits, group=pp_group, group_src=(total - 1) % pp)
    return logits
