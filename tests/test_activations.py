"""The activation model (plan/activations.py) against the memory probe, and its rules by hand.

The oracle: every parity plan of tests/test_parallel_parity.py (both families, every rank),
in fp32 and under bf16 autocast, trains one step on spawned gloo ranks; the probe's byte
counts (runtime/probes/memory.py) must equal plan/estimate's for parameters, gradients and
optimizer state, and its activation peak must be within ACT_TOLERANCE of the model's.
The pure tests check the scaling rules on hand-countable cases.
"""
from __future__ import annotations

import pytest

from interactive_parallel import Plan
from interactive_parallel.plan import PRESETS
from interactive_parallel.plan.activation_peak import peak_parts, predict_activations
from interactive_parallel.plan.activations import act_bytes, layer_parts, weight_elements
from interactive_parallel.plan.estimate import predict_memory
from interactive_parallel.plan.plan import schedule_order
from conftest import parity_plan_params

ACT_TOLERANCE = 0.10
"""Measured activation peaks are within this fraction of the prediction (the bound docs/planning.md states)."""

LLAMA, GPT2 = PRESETS["tiny-llama"], PRESETS["tiny-gpt2"]
H, I, HEADS = 64, 256, 4  # both tiny presets


# ---------------------------------------------------------------- rules, by hand (pure)

@pytest.mark.pure
def test_one_llama_block_counted_tensor_by_tensor():
    """fp32, 2 rows x 64 tokens: two RMSNorms (input, normalized input: h; 1/rms: 1), the
    attention's and the MLP's input (h each), q, k, v and the attention output (h each), the
    log-sum-exp (one per head), the MLP's gate, SiLU, up and product (i each)."""
    tokens = 2 * 64
    parts = layer_parts(LLAMA, Plan(batch_size=2), rows=2)
    assert parts.norms == 2 * tokens * (2 * H + 1) * 4
    assert parts.linear_inputs == 2 * tokens * H * 4
    assert parts.attention == tokens * (4 * H + HEADS) * 4
    assert parts.mlp == 4 * tokens * I * 4


@pytest.mark.pure
def test_gpt2_block_differs_only_by_its_family_data():
    """LayerNorm keeps its input, mean and 1/std; the tanh GELU keeps 5 intermediate-wide tensors."""
    tokens = 2 * 64
    parts = layer_parts(GPT2, Plan(batch_size=2), rows=2)
    assert parts.norms == 2 * tokens * (H + 2) * 4
    assert parts.mlp == 5 * tokens * I * 4
    assert parts.attention == layer_parts(LLAMA, Plan(batch_size=2), rows=2).attention


@pytest.mark.pure
def test_tensor_and_sequence_parallel_split_what_they_split():
    base = layer_parts(LLAMA, Plan(), rows=8)
    tp = layer_parts(LLAMA, Plan(tp=2), rows=8)
    sp = layer_parts(LLAMA, Plan(tp=2, sequence_parallel=True), rows=8)
    assert tp.mlp * 2 == base.mlp and tp.norms == base.norms and tp.linear_inputs == base.linear_inputs
    assert (tp.attention, tp.mlp, tp.linear_inputs) == (sp.attention, sp.mlp, sp.linear_inputs)
    assert sp.norms * 2 == tp.norms  # norms on sequence shards; the linears still see the gathered sequence


@pytest.mark.pure
def test_context_parallel_keeps_whole_sequence_k_and_v():
    """cp=2 halves every per-token tensor except K and V, gathered whole, and adds the mask of
    the rank's queries against every key (seq / cp x seq, fp32)."""
    rows, seq = 8, 64
    base = layer_parts(LLAMA, Plan(), rows=rows)
    cp = layer_parts(LLAMA, Plan(cp=2), rows=rows)
    assert cp.mlp * 2 == base.mlp and cp.norms * 2 == base.norms
    whole_kv = 2 * rows * seq * H * 4
    assert cp.attention == (base.attention - whole_kv) // 2 + whole_kv + (seq // 2) * seq * 4


@pytest.mark.pure
def test_ring_context_parallel_keeps_only_the_local_k_and_v():
    """Ring CP saves this rank's K/V block, as without cp: every attention tensor halves at cp=2."""
    base = layer_parts(LLAMA, Plan(), rows=8)
    ring = layer_parts(LLAMA, Plan(cp=2, cp_method="ring"), rows=8)
    assert ring.attention * 2 == base.attention and ring.mlp * 2 == base.mlp
    gather = layer_parts(LLAMA, Plan(cp=2), rows=8)
    assert gather.attention - ring.attention == 2 * 8 * 64 * H * 4 // 2 + 32 * 64 * 4  # the other half of K/V, the mask


@pytest.mark.pure
def test_autocast_halves_matmul_tensors_and_copies_each_linear_input_and_weight():
    fp32, bf16 = Plan(), Plan(precision="bf16")
    assert act_bytes(fp32) == 4 and act_bytes(bf16) == 2
    a, b = layer_parts(LLAMA, fp32, rows=8), layer_parts(LLAMA, bf16, rows=8)
    assert b.norms == a.norms and b.mlp * 2 == a.mlp
    assert b.linear_inputs == (3 + 2) * a.linear_inputs // 2 // 2  # q, k, v and gate, up: a copy each
    # every linear weight of the blocks and the LM head, once per step (fsdp: unsharded)
    block = 4 * H * H + 3 * H * I
    assert weight_elements(LLAMA, bf16, 0, last=True) == 4 * block + 128 * H
    assert weight_elements(LLAMA, Plan(fsdp=4, precision="bf16"), 3, last=True) == 4 * block + 128 * H
    assert weight_elements(LLAMA, Plan(tp=2, precision="bf16"), 1, last=True) == 4 * block // 2 + 128 * H // 2


@pytest.mark.pure
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_schedule_order_runs_each_microbatch_forward_then_backward(schedule, pp, m):
    plan = Plan(pp=pp, microbatches=m, pp_schedule=schedule, batch_size=8 * m)
    local = plan.virtual_stages if schedule == "interleaved-1f1b" else 1
    for rank in range(pp):
        order = schedule_order(plan, rank)
        for stage in range(local):
            acts = [a for a, s in order if s == stage]
            assert acts.count("F") == acts.count("B") == m
            depth = 0
            for a in acts:
                depth += 1 if a == "F" else -1
                assert depth >= 0, f"backward before its forward on rank {rank}"
        in_flight = max(sum(1 if a == "F" else -1 for a, _ in order[:k + 1]) for k in range(len(order)))
        if schedule == "1f1b":
            assert in_flight == min(m, pp - rank)
        if schedule == "gpipe":
            assert in_flight == m


def _torch_order(plan: Plan, rank: int) -> list[tuple[str, int]]:
    """The schedule class's own pipeline_order for `rank` (mock stages, no process group), as
    schedule_order spells it: I -> 'B', a full backward -> 'B', 'W'; overlapped F/B -> its halves."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(plan.schedule.torch_name, plan.pp, plan.n_microbatches, plan.stages_per_rank)
    local = {s: i for i, s in enumerate(plan.stage_ids(rank))}
    spelled = {"F": ["F"], "I": ["B"], "W": ["W"], "B": ["B", "W"]}
    out = []
    for action in ops[rank]:
        for a in (action.sub_actions or (action,)) if action is not None else ():
            out += [(x, local[a.stage_index]) for x in spelled[a.computation_type.value]]
    return out


@pytest.mark.rank1
@pytest.mark.parametrize("schedule,pp,m,v", [
    ("interleaved-zb", 2, 2, 2), ("interleaved-zb", 2, 3, 2), ("interleaved-zb", 2, 4, 2), ("interleaved-zb", 4, 8, 2),
    ("interleaved-zb", 2, 4, 3), ("interleaved-zb", 4, 6, 2),
    ("zbv", 2, 1, 2), ("zbv", 2, 2, 2), ("zbv", 2, 5, 2), ("zbv", 4, 4, 2), ("zbv", 4, 9, 2),
    ("dualpipev", 2, 4, 2), ("dualpipev", 2, 7, 2), ("dualpipev", 4, 8, 2), ("dualpipev", 4, 11, 2)])
def test_zero_bubble_order_is_torchs(schedule, pp, m, v):
    plan = Plan(pp=pp, microbatches=m, pp_schedule=schedule, virtual_stages=v, batch_size=4 * m)
    for rank in range(pp):
        order = schedule_order(plan, rank)
        assert order == _torch_order(plan, rank), (rank, order)
        for local in range(plan.stages_per_rank):
            acts = [a for a, s in order if s == local]
            assert acts.count("F") == acts.count("B") == acts.count("W") == m


@pytest.mark.pure
def test_zero_bubble_peak_keeps_linear_inputs_until_the_weight_half():
    one_f = Plan(pp=2, pp_schedule="1f1b", microbatches=4, batch_size=8)
    zbv = one_f.replace(pp_schedule="zbv")
    assert predict_activations(LLAMA, zbv, 0) > 0
    # the weight halves hold a stage's linear inputs a while longer than a full backward would
    (z, _), (f, _) = peak_parts(LLAMA, zbv, 1), peak_parts(LLAMA, one_f, 1)
    assert z.linear_inputs > 0 and z.total > 0 and f.total > 0


@pytest.mark.pure
def test_pipeline_peak_holds_the_in_flight_microbatches():
    gpipe = Plan(pp=2, pp_schedule="gpipe", microbatches=4, batch_size=8)
    one_f = gpipe.replace(pp_schedule="1f1b")
    (g, _), (f, _) = peak_parts(LLAMA, gpipe, 0), peak_parts(LLAMA, one_f, 0)
    assert g.total == 2 * f.total  # stage 0 of 2: four microbatches in flight against two
    assert predict_activations(LLAMA, one_f, 1) < predict_activations(LLAMA, one_f, 0)


# ---------------------------------------------------------------- measured (spawned gloo ranks: conftest.parity_steps)

@pytest.mark.multirank
@pytest.mark.parametrize("label,precision", parity_plan_params())
def test_prediction_within_ten_percent_of_the_probe(parity_steps, label, precision):
    from test_parallel_parity import ALL

    preset, fields = ALL[label]
    plan = Plan(**fields, precision=precision)
    predicted = predict_memory(PRESETS[preset], plan)
    got = {rank: memory for rank, (memory, _, _) in parity_steps[label, precision].items()}
    assert sorted(got) == list(range(plan.world_size))
    for rank, m in got.items():
        p = predicted[rank]
        assert (m.params, m.grads, m.optimizer) == (p.params, p.grads, p.optimizer), (rank, m, p)
        assert abs(p.activations - m.activations) <= ACT_TOLERANCE * m.activations, \
            f"rank {rank}: predicted {p.activations}, measured {m.activations} ({p.activations / m.activations:.3f})"


RING_PLANS = [("cp4-ring", "tiny-llama", dict(cp=4, cp_method="ring")),
              ("cp2xdp2-ring", "tiny-llama", dict(cp=2, dp=2, cp_method="ring"))]


@pytest.fixture(scope="module")
def ring_steps():
    from mp_harness import run_ranks
    from parity_workers import one_step_records

    return {precision: run_ranks(one_step_records, 4, RING_PLANS, precision) for precision in ("fp32", "bf16")}


@pytest.mark.multirank
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("label", [p[0] for p in RING_PLANS])
def test_ring_prediction_within_ten_percent_of_the_probe(ring_steps, label, precision):
    fields = {p[0]: p[2] for p in RING_PLANS}[label]
    plan = Plan(**fields, precision=precision)
    predicted = predict_memory(LLAMA, plan)
    for rank, recs in enumerate(ring_steps[precision]):
        m, p = recs[label][0], predicted[rank]
        assert (m.params, m.grads, m.optimizer) == (p.params, p.grads, p.optimizer), (rank, m, p)
        assert abs(p.activations - m.activations) <= ACT_TOLERANCE * m.activations, \
            f"rank {rank}: predicted {p.activations}, measured {m.activations} ({p.activations / m.activations:.3f})"
