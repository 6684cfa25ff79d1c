"""The dry run (runtime/client/dryrun.py) of mixture-of-experts plans: routing assumed uniform.

Oracles: a live run of the same plan on spawned gloo ranks (parameters, gradients and optimizer
state exactly; the same collectives on the same axes and groups, every byte equal but the
dispatch / combine all-to-alls', whose per-rank bytes follow the live routing (within 10 %) and
whose sum over the ep group does not (the tokens sent are the tokens received); the same
layout); the dry run that simulates every rank against the one that simulates one rank per
class and moves the records (an ep group need not span a whole mesh axis); and
plan.estimate.predict_memory. Qwen3-235B-A22B's shipped config on 256 virtual ranks (its time
and peak RSS are bench/bench_dryrun.py's to report).
"""
from __future__ import annotations

import collections
import math

import pytest

from interactive_parallel import Plan
from interactive_parallel.records import CommRecord, ShardRecord

TINY = dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SMALL = dict(batch_size=8, seq_len=16)
LIVE = {"dp2-ep2": dict(dp=2, ep=2), "fsdp2-ep2": dict(fsdp=2, ep=2), "dp2": dict(dp=2)}
ROUTING_TOL = 0.10
"""How far a live rank's routing-dependent bytes (token all-to-alls, activations) may sit from uniform."""


def _spec():
    from interactive_parallel.plan.models import spec_from_config_dict
    from interactive_parallel.runtime.model.families import with_facts

    return with_facts(spec_from_config_dict(TINY, name="tiny-mixtral"))


def _tokens_moved(c: CommRecord) -> bool:
    """A dispatch or combine all-to-all (its bytes follow the routing); the counts' are integers."""
    return c.op == "all_to_all" and not c.dtype.startswith("int")


def _comm_key(c: CommRecord) -> tuple:
    return (c.op, None if _tokens_moved(c) else c.bytes, c.dtype, c.axis, tuple(c.group), c.peer, c.module,
            c.needed_by, c.placements, c.implicit, c.phase)


def _shard_key(s: ShardRecord) -> tuple:
    return (s.param, s.rank, tuple(s.global_shape), tuple(s.local_shape), tuple(s.placements),
            tuple(s.mesh_axes), tuple(sorted(s.coords.items())), tuple(map(tuple, s.index)), s.stage)


def _per_rank(comms) -> dict[int, collections.Counter]:
    out: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for c in comms:
        out[c.rank][(c.op, c.bytes, c.dtype, c.axis, tuple(c.group), c.peer)] += 1
    return dict(out)


# ---------------------------------------------------------------- one rank per class, the estimate

@pytest.mark.rank1
@pytest.mark.parametrize("fields", [dict(dp=4, ep=2), dict(pp=2, dp=2, ep=2), dict(dp=2, tp=2, ep=2),
                                    dict(dp=2, fsdp=2, ep=4, recompute="full")],
                         ids=["dp4-ep2", "pp2xdp2-ep2", "dp2xtp2-ep2", "hsdp-ep4-recompute"])
def test_moe_classes_moved_equal_every_rank_simulated_and_the_estimate(fields):
    from transformers.integrations import moe

    from interactive_parallel import dry_run
    from interactive_parallel.plan.estimate import predict_memory

    can_use = moe._can_use_grouped_mm
    plan = Plan(**SMALL, **fields)
    every, classes = dry_run(TINY, plan, exhaustive=True), dry_run(TINY, plan)
    assert moe._can_use_grouped_mm is can_use, "the grouped_mm fallback is the dry run's only"
    assert len(classes.simulated) < plan.world_size == len(every.simulated)
    assert list(classes.memory()) == list(every.memory())
    # dp4-ep2: the ep groups [0, 1] and [2, 3] are runs of the dp axis, moved as ep groups
    assert _per_rank(classes.comms()) == _per_rank(every.comms())
    for rank in range(plan.world_size):
        assert sorted(map(_shard_key, classes.layout(rank=rank))) == sorted(map(_shard_key, every.layout(rank=rank)))
    assert {c.axis for c in classes.comms() if c.op == "all_to_all"} == {"ep"}
    for m, p in zip(classes.memory(), predict_memory(classes.spec, plan)):
        assert (m.params, m.grads, m.optimizer) == (p.params, p.grads, p.optimizer), m.rank
        assert math.isclose(m.activations, p.activations, rel_tol=0.10), (m.rank, m.activations, p.activations)
    # routing assumed uniform: every expert an even share of each rank's (token, slot) pairs
    for step in classes.steps():
        for r in step.experts:
            assert len(set(r.routed)) == 1 and len(set(r.tokens)) == 1
            assert sum(r.tokens) == sum(r.received) or not r.received


# ---------------------------------------------------------------- against a live run

@pytest.fixture(scope="module")
def live_steps():
    """{label: {rank: (MemoryRecord, [CommRecord], [ShardRecord])}}: one live step of each LIVE plan."""
    from mp_harness import run_ranks
    from parity_workers import one_step_records

    spec = _spec()
    configs = [(label, spec, dict(SMALL, **fields)) for label, fields in LIVE.items()]
    out: dict = {}
    for rank, recs in enumerate(run_ranks(one_step_records, 2, configs, "fp32", timeout_s=600)):
        for label, value in recs.items():
            out.setdefault(label, {})[rank] = value
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("label", list(LIVE))
def test_moe_dry_run_records_equal_a_live_run_but_for_routing(live_steps, label):
    from interactive_parallel import dry_run
    from interactive_parallel.plan.estimate import predict_memory

    plan = Plan(**SMALL, **LIVE[label])
    d = dry_run(TINY, plan)
    predicted = predict_memory(d.spec, plan)
    got = live_steps[label]
    # the fallback op keeps its offsets (an int32 per local expert) off autograd's saved tensors
    offsets = 4 * TINY["num_local_experts"] // plan.ep * TINY["num_hidden_layers"]
    moved = {"live": 0, "dry": 0}
    for rank, (memory, comms, shards) in got.items():
        dry = d.memory()[rank]
        assert (dry.params, dry.grads, dry.optimizer) == (memory.params, memory.grads, memory.optimizer), rank
        assert (dry.params, dry.grads, dry.optimizer) == \
            (predicted[rank].params, predicted[rank].grads, predicted[rank].optimizer), rank
        if plan.ep == 1:  # routing changes no shape: only the offsets differ
            assert memory.activations - dry.activations == offsets, rank
        else:
            assert math.isclose(dry.activations, memory.activations, rel_tol=ROUTING_TOL), rank
        dry_comms = list(d.comms(rank))
        assert collections.Counter(map(_comm_key, dry_comms)) == collections.Counter(map(_comm_key, comms)), rank
        live_a2a = sum(c.bytes for c in comms if _tokens_moved(c))
        dry_a2a = sum(c.bytes for c in dry_comms if _tokens_moved(c))
        assert math.isclose(dry_a2a, live_a2a, rel_tol=ROUTING_TOL), (rank, dry_a2a, live_a2a)
        moved["live"] += live_a2a
        moved["dry"] += dry_a2a
        assert sorted(map(_shard_key, d.layout(rank=rank))) == sorted(map(_shard_key, shards)), rank
    assert moved["live"] == moved["dry"], "over the ep group the tokens sent are the tokens received"
    if plan.ep > 1:
        mean = sum(m.activations for m, _, _ in got.values()) / len(got)
        assert math.isclose(d.memory()[0].activations, mean, rel_tol=0.01)


# ---------------------------------------------------------------- a shipped MoE on a big virtual mesh

@pytest.mark.rank1
def test_qwen3_235b_on_256_virtual_ranks():
    """Qwen3-235B-A22B's shape over 256 virtual ranks: pipeline 2, FSDP 128, experts over 16."""
    from interactive_parallel import dry_run
    from interactive_parallel.plan.estimate import predict_memory

    plan = Plan(pp=2, fsdp=128, ep=16, batch_size=256, seq_len=4096, precision="bf16", recompute="full")
    d = dry_run("qwen3-235b-a22b", plan)
    mem = d.memory()
    assert len(mem) == 256 and d.representatives == [0, 128]
    for m, p in zip(mem, predict_memory(d.spec, plan)):
        assert (m.params, m.grads, m.optimizer) == (p.params, p.grads, p.optimizer), m.rank
    # 94 layers x 8 of 128 experts per rank: each expert's stack split 16 ways, the rest over FSDP 128
    for rank, layer in ((0, 0), (255, 93)):  # the first rank of stage 0, the last of stage 1 (ep rank 15)
        held = {s.param: s for s in d.layout(rank=rank)}[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        assert held.local_shape == [8, 3072, 4096] and held.index[0] == [8 * (rank % 16), 8 * (rank % 16) + 8]
    ops = collections.Counter((c.op, c.axis) for c in d.comms(0))
    # per layer and micro-batch (2): counts, dispatch, combine; again in the recomputed forward; 2 back
    assert ops["all_to_all", "ep"] == 47 * 2 * 8
    assert {("all_gather", "fsdp"), ("reduce_scatter", "fsdp"), ("send", "pp"), ("all_reduce", "ep_replica")} <= set(ops)


@pytest.mark.rank1
def test_a_dry_run_takes_the_router_loss_too():
    """The load-balancing loss counts with fixed shapes, so it runs on a simulated rank's fake tensors."""
    from interactive_parallel import dry_run

    aux = dict(TINY, output_router_logits=True, router_aux_loss_coef=0.05)
    d = dry_run(aux, Plan(dp=2, ep=2, batch_size=8, seq_len=16))
    ops = {(c.op, c.axis) for c in d.iter_comms([0])}
    assert ("all_to_all", "ep") in ops and ("all_reduce", "dp") in ops
