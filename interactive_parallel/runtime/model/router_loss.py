"""The router's load-balancing loss of a mixture of experts, over the whole global batch.

Owns collecting each MoE layer's router logits during a forward (a hook on the router) and the
auxiliary loss transformers adds when a config sets `output_router_logits`
(`load_balancing_loss_func` of Mixtral, Qwen3-MoE and the others: num_experts x the sum over
experts of the fraction of (token, slot) pairs routed to it times its mean router probability,
both taken over every layer's rows at once), weighted by the config's `router_aux_loss_coef`.
Ours because transformers' function takes one process's rows: both factors are means over
the batch, so per-rank losses averaged would not be the loss of the batch. Here the counts,
probability sums and row counts are summed over the data-parallel ranks first (the probability
sum through the autograd all-reduce, whose backward sums the gradients; FSDP / replicate's
mean then gives every router the gradient of the global loss). Under tp every tp rank routes
the same rows and computes the same loss. Under pp the layers' rows sit on different stages;
that combination is refused by plan.validate. With grad_accum > 1 the loss is taken per
micro-step, as transformers takes it per forward: a micro-step's rows over the data-parallel
ranks are other rows than one process's micro-step (each rank cuts its own share), and this
loss, unlike the cross-entropy, is not a sum over rows, so such runs differ from one process
by the choice of rows. Knows nothing of the training loop beyond the
loss it returns.
"""
from __future__ import annotations

import torch
from torch import nn

from ...plan import ModelSpec


def wanted(spec: ModelSpec) -> bool:
    """Whether the config turns the loss on (a MoE model with output_router_logits and a coefficient)."""
    experts = spec.family_info.experts
    return bool(experts is not None and experts.aux_loss_key and spec.config.get("output_router_logits")
                and spec.config.get(experts.aux_loss_key))


class RouterLogits:
    """The router logits of the forwards since the last `take` (not those of a recomputation)."""

    def __init__(self, raw: nn.Module, spec: ModelSpec, layer_ids: list[int], group=None):
        fam = spec.family_info
        self.group = group  # the data-parallel ranks the batch is spread over (None: this rank alone)
        layers = raw.get_submodule(fam.layers_path)
        self.logits: list[torch.Tensor] = []
        self.coef = float(spec.config[fam.experts.aux_loss_key])
        self.num_experts, self.top_k = spec.num_experts, spec.experts_per_token
        for i in layer_ids:
            layers[i].get_submodule(fam.experts.router_path).register_forward_hook(self._keep)

    def _keep(self, _module, _args, out) -> None:
        from .recomputed import in_backward

        if torch.is_grad_enabled() and not in_backward():
            self.logits.append(out[0] if isinstance(out, tuple) else out)

    def take(self) -> torch.Tensor | None:
        """coef x the batch's load-balancing loss over the group's ranks (None: no forward was kept)."""
        logits, self.logits = self.logits, []
        if not logits:
            return None
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=logits[0].device)
        probs = torch.zeros_like(counts)
        rows = torch.zeros((), dtype=torch.float32, device=counts.device)
        for layer in logits:
            weights = torch.softmax(layer.float(), dim=-1)  # [rows, experts]
            chosen = torch.topk(weights, self.top_k, dim=-1).indices
            # a fixed-shape count (bincount's shape depends on the ids: a dry run's fake tensors have none)
            counts = counts.scatter_add(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=counts.device))
            probs = probs + weights.sum(dim=0)
            rows = rows + weights.shape[0]
        if self.group is not None:
            import torch.distributed as dist
            import torch.distributed._functional_collectives as funcol

            sums = torch.cat([counts, rows.reshape(1)])
            dist.all_reduce(sums, group=self.group)
            counts, rows = sums[:-1], sums[-1]
            probs = funcol.all_reduce(probs, "sum", self.group)
        return self.coef * self.num_experts * torch.sum((counts / rows) * (probs / rows))
