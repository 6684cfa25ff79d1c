"""Rank-side bodies of the comm ledger's tests (module level, so spawned ranks can import them).

The oracle beside the ledger is torch's own CommDebugMode (`counter`), extended to note each op
it dispatches with the bytes, kind and group the ledger's conventions give it
(runtime/probes/ledger.py, restated here independently of it). Knows nothing of pytest.
"""
from __future__ import annotations

from interactive_parallel.plan import Plan
from parity_workers import as_spec

# op name -> kind, for every op CommDebugMode dispatches that moves bytes between ranks
KIND = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    "broadcast": "broadcast", "broadcast_": "broadcast", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter", "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}
P2P = {"send", "recv_", "recv_any_source_"}
"""Point-to-point ops: CommDebugMode dispatches them but does not count them (its registry holds
collectives only); the counter below notes them as it notes the rest."""


def _tensors(x) -> list:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def describe(func, args, kwargs, out) -> tuple[str, int, tuple[int, ...]]:
    """(kind, bytes, group ranks) of one dispatched op: bytes of its full buffer (all_gather's
    output, reduce_scatter's and all_to_all's input, any other op's tensors)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = func._overloadpacket.__name__
    kind = KIND[name]
    bound = dict(zip([a.name for a in func._schema.arguments], args), **(kwargs or {}))
    if "group_name" in bound:
        pg = _resolve_process_group(bound["group_name"])
    else:
        pg = dist.ProcessGroup.unbox(bound["process_group"])
    if kind == "all_gather":
        picked = [v for k, v in bound.items() if k.startswith("output")]
        ts = _tensors(picked[0] if picked else out)
    elif kind in ("reduce_scatter", "all_to_all"):
        ts = _tensors([v for k, v in bound.items() if k.startswith("input")][0])
    else:
        ts = _tensors(bound.get("tensors", bound.get("input", bound.get("inputs"))))
    return kind, sum(t.numel() * t.element_size() for t in ts), tuple(dist.get_process_group_ranks(pg))


class NoModules:
    """In place of CommDebugMode's module tracker, which counts every collective under "Global"
    here: torch's (ModTracker's multi-grad hooks on each module's inputs) makes a zero-bubble
    pipeline's split backward fail (torch.autograd.grad: "A leaf node was passed to
    _will_engine_execute_node"), and transformers' rotary module, called by every layer, unbalances
    its parent list."""

    name, is_bw, activation_checkpointing = "Global", False, False
    module_parents_dict = {"Global": set()}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def counter():
    """torch's CommDebugMode (a TorchDispatchMode: DTensor ops desugar into their collectives
    before it counts them; its counting, without its module tracker: NoModules), noting (kind,
    bytes, group) of each op it counts, and of the point-to-point ops it passes by, in `.seen`."""
    import torch
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

    p2p = {getattr(torch.ops.c10d, n) for n in P2P}

    class Counter(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.advanced_module_tracker = NoModules()
            self.seen: list[tuple[str, int, tuple[int, ...]]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            packet = getattr(func, "_overloadpacket", None)
            if out is not NotImplemented and (packet in self.comm_registry or packet in c10d_collective_ops
                                              or packet in p2p):
                self.seen.append(describe(func, args, kwargs, out))
            return out

    return Counter()


def _local_weights(par) -> list:
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in par.parameters()]


def _one_step(spec, plan: Plan, rank: int, traced: bool, mode=None):
    """(StepRecord, local weights after it) of one training step from the seeded start."""
    import contextlib

    from interactive_parallel.runtime import probes
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.rank import state
    from interactive_parallel.runtime.training.train import make_optimizer, train_step

    before = probes.set_tracing(traced)
    try:
        par = parallelize(spec, plan)
        opt = make_optimizer(par)
        with mode if mode is not None else contextlib.nullcontext():
            rec = train_step(par, opt, 0, rank=rank)
        weights = _local_weights(par)
    finally:
        probes.set_tracing(before)
        state.get().reset_model()
    return rec, weights


def ledger_beside_counter(rank: int, configs: list[tuple[str, str, dict]]) -> dict:
    """{label: {"ledger": [(kind, bytes, group)], "counter": [...], "counts": {op: n}, "causes":
    [CommRecord as a dict], "same_numbers": bool}}: one training step per plan on this rank, the
    comm ledger on (as every step) and tracing its causes, inside the counter; then the same
    step untraced, outside it: its loss and the weights after it must be bitwise the same."""
    import torch

    out = {}
    for label, preset, fields in configs:
        spec, plan = as_spec(preset), Plan(**fields)
        mode = counter()
        rec, weights = _one_step(spec, plan, rank, traced=True, mode=mode)
        plain, plain_weights = _one_step(spec, plan, rank, traced=False)
        same = (rec.loss == plain.loss or (rec.loss != rec.loss and plain.loss != plain.loss)) and \
            len(weights) == len(plain_weights) and all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
        out[label] = {"ledger": [(c.op, c.bytes, tuple(c.group)) for c in rec.comms], "counter": mode.seen,
                      "counts": {str(k): v for k, v in mode.get_comm_counts().items()},
                      "causes": [c.to_dict() for c in rec.comms], "untraced": [c.to_dict() for c in plain.comms],
                      "same_numbers": same}
    return out
