"""Expert parallelism: each MoE layer's experts split over the ep ranks, tokens sent to them and back.

Owns applying transformers' own expert-parallel plan (the config's `base_model_ep_plan`, each
style's facts its record's in plan.ep_styles: `grouped_gemm` splits the stacked expert weights on
dim 0 as DTensors on the ep mesh, `ep_dispatch_experts` routes the experts' forward through an
EPImplementation) with one
implementation registered here, `CountedAllToAll`: transformers' AllToAllEP (the per-expert
counts exchanged with all_to_all_single, then the tokens with the autograd
all_to_all_single, there and back; under tp each tp rank sends its slice of the tokens)
that also keeps what it moved. Also owns:
- the ep meshes: a second DeviceMesh (pp, replica, ep, tp) over the same ranks in the same
  order, since expert parallelism rides on the data-parallel ranks (plan.expert_coords);
- which parameters are expert weights: they are kept out of FSDP / replicate (whose groups
  span the ranks that hold other experts) and their gradients summed over the replica group
  here (`sync_expert_grads`), divided as FSDP divides the others;
- the routing counts of a step (RoutingCounter -> records.ExpertRecord): per MoE layer, the
  tokens this rank's tokens chose of every expert, the (token, slot) pairs each local
  expert processed, and those sent to and received from every ep peer.
transformers' EP code is used as it is; only the counting is ours. One mode departs from it, for
the dry run (runtime/client/dryrun.py, whose fake tensors hold no ids to count): with the counter's
`uniform` set, routing is assumed uniform: the counts are the even split of the (token, slot)
pairs computed from shapes (`spread`) and the all-to-alls are issued with those split sizes
(the same three calls: counts, dispatch, combine). Knows nothing of the training loop, of
records' transport or of the client.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...plan import MeshAxis, ModelSpec, Plan, expert_coords, expert_groups, mesh_coords
from ...plan.ep_styles import EP_STYLES
from ...records import ExpertRecord
from ..groups.mesh import cached

IMPLEMENTATION = "interactive_parallel_counted"


def spread(total: int, parts: int, first: int = 0) -> list[int]:
    """`total` split over `parts` as evenly as whole numbers go, the remainder one each to the
    parts from `first` on, cyclically (a sender starting at its own index: every part then
    receives as many in all as it sends)."""
    base, extra = divmod(total, parts)
    return [base + int((i - first) % parts < extra) for i in range(parts)]


class RoutingCounter:
    """The routing counts of the forwards since the last `take`, per MoE layer index."""

    uniform = False
    """Routing assumed uniform (the dry run): counts from shapes, not ids; the all-to-alls' split sizes too."""

    def __init__(self, num_experts: int, held: dict[int, list[int]], ep_group: list[int], tp_rank: int):
        self.num_experts, self.held, self.ep_group, self.tp_rank = num_experts, held, ep_group, tp_rank
        self._routed: dict[int, list[int]] = {}
        self._processed: dict[int, list[int]] = {}
        self._moved: dict[int, list[list[int]]] = {}

    @staticmethod
    def counting() -> bool:
        """Not inside a backward pass: a recomputed forward (activation checkpointing) routes the
        same tokens again and is not counted twice."""
        from ..model.recomputed import in_backward

        return not in_backward()

    def _counts(self, ids: torch.Tensor, n: int) -> list[int]:
        """Per-expert counts of `ids` among `n` experts (uniform: the even split of their number)."""
        if self.uniform:
            return spread(ids.numel(), n)
        return torch.bincount(ids.reshape(-1).to(torch.long), minlength=n).cpu()[:n].tolist()

    def routed(self, layer: int, top_k_index: torch.Tensor) -> None:
        if self.counting():
            self._routed[layer] = _added(self._routed.get(layer), self._counts(top_k_index, self.num_experts))

    def processed(self, layer: int, local_ids: torch.Tensor, sent: list[int], received: list[int]) -> None:
        if self.counting():
            self._processed[layer] = _added(self._processed.get(layer), self._counts(local_ids, len(self.held[layer])))
            before = self._moved.get(layer, [[0] * len(sent), [0] * len(received)])
            self._moved[layer] = [_added(before[0], sent), _added(before[1], received)]

    def take(self, step: int, rank: int) -> list[ExpertRecord]:
        out = []
        for layer in sorted(self._routed):
            routed = [int(x) for x in self._routed[layer]]
            held = self.held[layer]
            if layer in self._processed:
                tokens = [int(x) for x in self._processed[layer]]
                sent, received = self._moved[layer]
            else:  # every expert here: each processed what this rank routed to it
                tokens, sent, received = [routed[e] for e in held], [], []
            out.append(ExpertRecord(rank=rank, step=step, layer=layer, experts=list(held), tokens=tokens,
                                    routed=routed, sent=list(sent), received=list(received),
                                    ep_group=list(self.ep_group), tp_rank=self.tp_rank))
        self._routed.clear()
        self._processed.clear()
        self._moved.clear()
        return out


def _added(before: list[int] | None, counts: list[int]) -> list[int]:
    return list(counts) if before is None else [a + b for a, b in zip(before, counts)]


def _register() -> None:
    from torch.distributed import all_to_all_single
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from transformers.distributed.expert_parallel import (AllToAllEP, EPImplementationInterface, _AllToAllState,
                                                          _WaitTensor)

    if IMPLEMENTATION in EPImplementationInterface._global_mapping:
        return

    class CountedAllToAll(AllToAllEP):
        """transformers' AllToAllEP, keeping the counts it exchanged (its `_dispatch_tokens` has them)."""

        def __init__(self, experts: nn.Module, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            self.layer = experts._ip_layer
            self.counter: RoutingCounter = experts._ip_counter

        def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
            dispatch = self._uniform_dispatch if self.counter.uniform else super()._dispatch_tokens
            tokens, expert_ids, weights, state = dispatch(hidden_states, top_k_index, top_k_weights)
            self.counter.processed(self.layer, expert_ids, state.send_sizes, state.recv_sizes)
            return tokens, expert_ids, weights, state

        def _uniform_dispatch(self, hidden_states, top_k_index, top_k_weights):
            """AllToAllEP._dispatch_tokens with routing assumed uniform: the same collectives (counts,
            then tokens) with split sizes from shapes (`spread`), none read back from the counts."""
            num_tokens = hidden_states.size(0)
            if self.tp_mesh.size() > 1:
                hidden_states, top_k_index, top_k_weights = (
                    DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                    .redistribute(self.tp_mesh, [Shard(0)]).to_local()
                    for t in (hidden_states, top_k_index, top_k_weights))
            group, ep, me, local = self.ep_mesh.get_group(), self.ep_mesh.size(), self.ep_mesh.get_local_rank(), \
                self.num_local_experts
            expert_ids = top_k_index.reshape(-1)
            order = torch.argsort(expert_ids)
            send_tokens = hidden_states[order // top_k_index.size(-1)]
            pairs = expert_ids.numel()  # every peer of the ep group holds as many (the same shapes)
            send_sizes = spread(pairs, ep, first=me)
            recv_sizes = [spread(pairs, ep, first=peer)[me] for peer in range(ep)]
            device = hidden_states.device
            send_counts = torch.tensor([c for n in send_sizes for c in spread(n, local)], device=device).view(ep, local)
            all_to_all_single(torch.empty_like(send_counts), send_counts, group=group)
            recv_tokens = _WaitTensor.apply(all_to_all_single_autograd(send_tokens, recv_sizes, send_sizes, group))
            per_expert = torch.tensor([c for n in recv_sizes for c in spread(n, local)], device=device)
            recv_ids = torch.arange(local, device=device).repeat(ep).repeat_interleave(
                per_expert, output_size=sum(recv_sizes)).unsqueeze(-1)
            weights = torch.ones_like(recv_ids, dtype=recv_tokens.dtype)
            return recv_tokens, recv_ids, weights, _AllToAllState(top_k_weights, order, send_sizes, recv_sizes,
                                                                  num_tokens)

    EPImplementationInterface.register(IMPLEMENTATION, CountedAllToAll)


def ep_meshes(plan: Plan, device_type: str):
    """(the (pp, replica, ep, tp) mesh, this rank's replica group): the replica group holds the
    ranks with this rank's experts (same pp and ep coordinates), whose expert gradients are summed."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (plan.pp, plan.expert_replicas, plan.ep, plan.tp)
    mesh = cached(("ep-mesh", device_type, shape),
                  lambda: init_device_mesh(device_type, shape, mesh_dim_names=("pp", "replica", "ep", "tp")))
    rank = dist.get_rank()
    mine = None
    for ranks in expert_groups(plan.mesh_shape, plan.ep)[1]:
        group = cached(("expert-replicas", tuple(ranks)), lambda: dist.new_group(ranks)) if len(ranks) > 1 else None
        if rank in ranks:
            mine = group
    return mesh, mine


def attach_counter(raw: nn.Module, spec: ModelSpec, plan: Plan, layer_ids: list[int], rank: int) -> RoutingCounter:
    """A RoutingCounter fed by every MoE layer this rank holds (a pre-hook on each experts module
    sees the top-k expert ids its router chose)."""
    fam, experts = spec.family_info, spec.family_info.experts
    layers = raw.get_submodule(fam.layers_path)
    n, ep = spec.num_experts, plan.ep
    _, ep_rank = expert_coords(rank, plan.mesh_shape, ep)
    local = n // ep
    groups = expert_groups(plan.mesh_shape, ep)[0]
    ep_group = next(g for g in groups if rank in g) if ep > 1 else [rank]
    tp_rank = _tp_rank(rank, plan)
    held = {i: list(range(ep_rank * local, (ep_rank + 1) * local)) for i in layer_ids}
    counter = RoutingCounter(n, held, ep_group, tp_rank)
    for i in layer_ids:
        module = layers[i].get_submodule(experts.experts_path)
        module._ip_layer, module._ip_counter = i, counter
        module.register_forward_pre_hook(lambda _m, args, kwargs, i=i: counter.routed(
            i, args[1] if len(args) > 1 else kwargs["top_k_index"]), with_kwargs=True)
    return counter


def _tp_rank(rank: int, plan: Plan) -> int:
    return mesh_coords(rank, plan.mesh_shape)[MeshAxis.TP]


def apply_ep(raw: nn.Module, spec: ModelSpec, plan: Plan, layer_ids: list[int], device_type: str) -> tuple[list, Any]:
    """Split the experts of `layer_ids` over the ep ranks with the config's EP plan; returns
    (the expert parameters, the replica group their gradients are summed over)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    _register()
    mesh, replicas = ep_meshes(plan, device_type)
    fam, experts = spec.family_info, spec.family_info.experts
    per_layer = {}
    for key, style in experts.ep_plan.items():
        rest = key.split(".*.", 1)[1]
        for i in layer_ids:
            per_layer[f"{fam.layers_path}.{i}.{rest}"] = style
    # transformers applies a module's forward before its parameters are known to it: params first
    order = sorted(per_layer, key=lambda k: EP_STYLES[per_layer[k]].dispatches)
    apply_expert_parallelism(raw, mesh["ep"], mesh["tp"], {k: per_layer[k] for k in order},
                             ep_implementation=IMPLEMENTATION)
    return expert_parameters(raw, spec, layer_ids), replicas


def expert_parameters(raw: nn.Module, spec: ModelSpec, layer_ids: list[int]) -> list[nn.Parameter]:
    fam = spec.family_info
    layers = raw.get_submodule(fam.layers_path)
    return [p for i in layer_ids for p in layers[i].get_submodule(fam.experts.experts_path).parameters()]


@torch.no_grad()
def sync_expert_grads(params: list[nn.Parameter], group, data_ranks: int) -> None:
    """Each expert's gradient summed over the ranks holding it, over `data_ranks`: an expert's
    rank already summed, through the all-to-all's backward, what its ep peers' tokens gave it;
    the replica group adds the other replicas' (and the tp ranks' slices), and the division is
    the data-parallel mean every other gradient gets from FSDP / replicate."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        from ..probes.ledger import labelled

        with labelled("ep_replica"):
            dist.all_reduce(flat, group=group)
    flat /= data_ranks
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
