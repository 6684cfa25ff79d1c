"""The Parallelized handle: a model laid out under a plan on this rank, and what it can do.

Owns the answers train, generate, verify and checkpoint need without knowing the layout:
which module (or pipeline schedule) to call, which slice of the global batch is this
rank's, whether this rank sees the loss, full-sequence logits on every rank, full
weights and gradients gathered under the transformers names (fused weights put back in
checkpoint order), the tied embedding/head gradient summed across pipeline stages, a
gradient DTensor left Partial summed once after backward, and rebuilding the schedule when the batch shape changes. Knows nothing of how the layout
was made (runtime.layout.parallelize does that) or of ipyparallel.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...plan import MeshAxis, ModelSpec, Plan

REDUCE_PARTIAL = [True]
"""Whether finish_grads sums each gradient DTensor's sharding propagation left Partial (a norm's
weight replicated beside sequence-split activations) once, explicitly. Left to the optimizer,
every AdamW op that reads such a gradient makes DTensor all-reduce it again, implicitly (three
times a step). False only to show that cost (notebook 06); the numbers are the same either way."""


@dataclass
class Parallelized:
    """Handles of a model laid out under a plan on this rank."""

    plan: Plan
    spec: ModelSpec
    model: nn.Module
    """The module a forward is called on (DDP/FSDP/TP model; ModuleList of stages under PP)."""
    raw: nn.Module
    """The transformers model underneath the wrappers (same parameters)."""
    mesh: Any = None
    coords: dict = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    stages: list = field(default_factory=list)
    """Pipeline stage modules held by this rank (empty without PP)."""
    schedule: Any = None
    """torch.distributed.pipelining schedule (None without PP)."""
    perms: dict = field(default_factory=dict)
    """Param name -> (dim, permutation) of its sharded logical layout (a fused q|k|v under TP)."""
    aliases: dict = field(default_factory=dict)
    """Second name of a tied weight -> its first name ('lm_head.weight' -> the embedding's), as
    built: FSDP or a pipeline split may hold the two as separate tensors on a rank."""
    tie_group: Any = None
    """Ranks holding the tied embedding and LM head in different pipeline stages."""
    cp_model: Any = None
    """Under CP: the whole-model StageModule that takes position ids."""
    schedule_key: tuple = ()
    """The plan knobs the schedule was built for (its stages fix their shapes at first use)."""
    measured_bytes: dict = field(default_factory=dict)
    """The probes' last byte counts (params, grads, optimizer, activations) per batch shape."""
    routing: Any = None
    """A mixture of experts' routing counts since the last step (runtime.parallel.ep.RoutingCounter)."""
    expert_params: list = field(default_factory=list)
    """Under ep: the expert weights (kept out of FSDP / replicate; their gradients synced here)."""
    expert_group: Any = None
    """Under ep: the ranks holding this rank's experts (None: no other)."""
    computes_like: Any = None
    """A one-process model computing as this Plan's FSDP units would (verify's reference of a plan
    that gathers bf16 parameters, Plan.gathers_bf16), or None."""
    router_logits: Any = None
    """The router logits the config's load-balancing loss reads (runtime.model.router_loss), or None."""

    def with_router_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` plus the routers' load-balancing loss over the whole batch, when the config asks
        for it (a collective over the data-parallel ranks), scaled as `loss` is by grad_accum."""
        aux = self.router_logits.take() if self.router_logits is not None else None
        return loss if aux is None else loss + aux / self.plan.grad_accum

    @property
    def data_index(self) -> int:
        """Which slice of the global batch this rank trains on."""
        return self.coords.get(MeshAxis.DP, 0) * self.plan.fsdp + self.coords.get(MeshAxis.FSDP, 0)

    @property
    def data_count(self) -> int:
        return self.plan.data_parallel

    @property
    def sees_loss(self) -> bool:
        """False on pipeline ranks without the last stage: they never hold the logits."""
        return not self.stages or any(s.last for s in self.stages)

    @property
    def has_first(self) -> bool:
        return not self.stages or any(s.first for s in self.stages)

    def group(self, axis: MeshAxis):
        if self.mesh is None or getattr(self.plan, axis.value) == 1:
            return None
        return self.mesh[axis.value].get_group()

    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for p in self.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def forward_logits(self, input_ids: torch.Tensor, attention_mask=None, position_ids=None,
                       sharded: bool = False) -> torch.Tensor:
        """Full-sequence logits on every rank (a collective under PP/TP/FSDP). Under loss parallel
        they are split on the vocabulary: `sharded` keeps them so (the DTensor the loss takes),
        else they are gathered whole."""
        logits = self._logits(input_ids, attention_mask, position_ids)
        return logits if sharded or not hasattr(logits, "full_tensor") else logits.full_tensor()

    def _logits(self, input_ids: torch.Tensor, attention_mask, position_ids) -> torch.Tensor:
        if self.schedule is not None:
            from ..parallel.pp import pipeline_forward

            return pipeline_forward(self.stages, self.plan, self.group(MeshAxis.PP), input_ids,
                                    self.spec.hidden_size, self.spec.vocab_size,
                                    attention_mask=attention_mask, position_ids=position_ids)
        if self.cp_model is not None:
            from ..parallel.cp import whole_sequence

            with whole_sequence():
                return self.cp_model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        if self.computes_like is not None:  # set only for a plan that gathers bf16 (verify.computes_like)
            return self._logits_in_bf16(kwargs)
        return self.model(**kwargs).logits

    def _logits_in_bf16(self, kwargs: dict) -> torch.Tensor:
        """The forward on bf16 copies of the parameters, as FSDP's units gather them; under ep
        the experts stay out, as FSDP leaves them (runtime.parallel.fsdp.cast_parameters)."""
        from torch.func import functional_call

        from ..parallel.fsdp import cast_parameters

        experts = self.spec.family_info.experts
        skip = []
        if experts is not None and self.computes_like.ep > 1:
            skip = [p for n, p in self.model.named_parameters() if f".{experts.experts_path}." in n]
        params = cast_parameters(self.model, torch.bfloat16, skip)
        return functional_call(self.model, params, (), kwargs).logits

    def refresh_schedule(self) -> None:
        """Rebuild the pipeline schedule if batch, sequence or microbatch knobs changed.

        A PipelineStage keeps the buffer shapes of its first step; running it with other
        shapes aborts the process on gloo (measured), so update_training must not reuse it.
        """
        from ..parallel.pp import apply_schedule, schedule_shape

        if self.schedule is None or schedule_shape(self.plan) == self.schedule_key:
            return
        self.schedule, self.schedule_key = apply_schedule(self.stages, self.plan, self.group(MeshAxis.PP),
                                                          self.device)

    def finish_grads(self) -> None:
        """After backward: sum each gradient left Partial over the mesh axes it is partial on, the
        tied embedding/head gradient over the stages that hold it, and under ep each expert's
        gradient over the ranks holding that expert."""
        if REDUCE_PARTIAL[0]:
            self.reduce_partial_grads()
        if self.expert_params:
            from ..parallel.ep import sync_expert_grads

            sync_expert_grads(self.expert_params, self.expert_group, self.plan.data_ranks)
        if self.tie_group is None:
            return
        fam = self.spec.family_info
        tied = ([self.raw.get_submodule(fam.embedding_path).weight] if self.has_first else []) + \
               ([self.raw.get_submodule(fam.lm_head_path).weight] if self.sees_loss else [])
        for p in {id(p): p for p in tied}.values():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=self.tie_group)

    def reduce_partial_grads(self) -> None:
        """Redistribute every Partial gradient to its parameter's placements: one all-reduce per
        tensor, in backward's phase, named by the module that owns the parameter."""
        from torch.distributed.tensor import DTensor

        from ..probes.causes import issuer

        for name, p in self.raw.named_parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                with issuer(name.rpartition(".")[0]):
                    p.grad = g.redistribute(g.device_mesh, p.placements)

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    def owned_keys(self) -> list[str]:
        keys = list(self.raw.state_dict().keys())
        if not self.stages:
            return keys
        prefixes = tuple(p for s in self.stages for p in s.owned_prefixes)
        return [k for k in keys if k.startswith(prefixes)]

    def _gather(self, tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Full CPU tensors under the transformers names, from every layout (a collective)."""
        from ..parallel.tp import unpermute

        out = {}
        for name, t in tensors.items():
            if t is None:
                continue
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            full = full.detach().to("cpu", copy=True)
            if name in self.perms:
                full = unpermute(full, *self.perms[name])
            out[name] = full
        pp_group = self.group(MeshAxis.PP)
        if pp_group is not None:
            # Each stage owns its keys; every rank needs them all (apply_plan, verify).
            parts: list = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(parts, out, group=pp_group)
            out = {k: v for part in parts for k, v in part.items()}
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer as a full CPU tensor (a collective: every rank must call it)."""
        state = self.raw.state_dict()
        return self._gather({k: state[k] for k in self.owned_keys()})

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients under the parameter names (a collective)."""
        owned = set(self.owned_keys())
        named = {n: p.grad for n, p in self.raw.named_parameters() if n in owned}
        grads = self._gather(named)
        if self.spec.tied_embeddings:
            # One parameter, one gradient: under the embedding's name, as named_parameters()
            # of the plain model gives it (a pipeline or FSDP may have split the pair apart).
            fam = self.spec.family_info
            head = grads.pop(f"{fam.lm_head_path}.weight", None)
            if head is not None:
                grads.setdefault(f"{fam.embedding_path}.weight", head)
        return grads
