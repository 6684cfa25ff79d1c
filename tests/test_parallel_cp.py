"""Context-parallel attention on its own: output, dQ, dK and dV against causal SDPA on one process;
ring CP (`cp_method="ring"`) at model parity and its comm ledger.

dK and dV are the gradients that cross ranks (each rank's keys serve every later query),
so they are the ones a wrong all-gather (or ring) backward gets wrong while dQ stays right.
Tolerance CP_TOL = 1e-5 absolute. Ring model runs are held to the parity suite's fp32 bounds
(loss and grads 1e-5, weights 1e-4 after AdamW steps). Also the load-balanced split itself (pure).
"""
from __future__ import annotations

import pytest
import torch

from mp_harness import run_ranks
import parity_workers as W
from interactive_parallel.plan import PRESETS, Plan, validate
from interactive_parallel.plan.estimate import predict_comms
from interactive_parallel.runtime.parallel.cp import local_positions, shard_sequence

CP_TOL = 1e-5
LOSS_TOL, GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-5, 1e-4
STEPS = 2
SHAPE = (2, 4, 16, 8)  # batch, heads, sequence, head dim
# (shape, cp, method, query heads per kv head, sliding window)
CASES_4 = [(SHAPE, 4, "ring", 1, None), (SHAPE, 4, "ring", 2, 5), (SHAPE, 4, "allgather", 2, 5)]
LLAMA = "tiny-llama"
CONFIGS_4 = [
    ("llama-cp4-ring", LLAMA, dict(cp=4, cp_method="ring")),
    ("llama-cp2xdp2-ring", LLAMA, dict(cp=2, dp=2, cp_method="ring")),
    ("llama-cp2xtp2-ring", LLAMA, dict(cp=2, tp=2, cp_method="ring")),
]
COMM_PLAN = dict(cp=4, cp_method="ring")


@pytest.mark.pure
def test_load_balanced_split_pairs_early_and_late_chunks():
    t = torch.arange(16).view(1, 16)
    assert shard_sequence(t, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(t, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert local_positions(8, 2, 1, "cpu").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.pure
def test_ring_seq_len_not_divisible_by_the_chunks_is_refused_with_its_numbers():
    problems = validate(Plan(cp=4, cp_method="ring", seq_len=60), 4, PRESETS[LLAMA])
    assert "seq_len(60) is not divisible by 2 * cp(4) = 8" in problems


def _check_attention(got: list, cases: list) -> None:
    for i, (shape, cp, method, groups, window) in enumerate(cases):
        ref = W.cp_attention_reference(shape, groups, window)
        for key, dim in (("out", 1), ("dq", 2), ("dk", 2), ("dv", 2)):
            for rank in range(cp):
                want = shard_sequence(ref[key], cp, rank, dim=dim)
                diff = float((got[rank][i][key] - want).abs().max())
                assert diff <= CP_TOL, f"{method} g{groups} w{window} {key} on rank {rank}: max difference {diff:.2e}"


@pytest.mark.multirank
def test_cp_attention_output_and_gradients():
    cases = [(SHAPE, 2, "allgather", 1, None), (SHAPE, 2, "ring", 1, None)]
    _check_attention(run_ranks(W.cp_attention_cases, 2, cases), cases)


@pytest.fixture(scope="module")
def ring4():
    return run_ranks(W.ring_group, 4, CASES_4, CONFIGS_4, STEPS, COMM_PLAN)


@pytest.mark.multirank
def test_ring_attention_cp4_gqa_and_window(ring4):
    _check_attention([r["attention"] for r in ring4], CASES_4)


@pytest.mark.multirank
@pytest.mark.parametrize("label", [c[0] for c in CONFIGS_4])
def test_ring_parity(ring4, label):
    preset, fields = {c[0]: (c[1], c[2]) for c in CONFIGS_4}[label]
    ref, got = W.reference(preset, fields, STEPS), ring4[0]["parity"][label]
    dloss = max(abs(a - b) for a, b in zip(ref["losses"], got["losses"]))
    dgrad, dweight = W.max_diff(ref["grads"], got["grads"]), W.max_diff(ref["weights"], got["weights"])
    print(f"{label}: dloss {dloss:.2e} dgrad {dgrad:.2e} dweight {dweight:.2e}")
    assert dloss <= LOSS_TOL and dgrad <= GRAD_TOL and dweight <= WEIGHT_TOL, (label, dloss, dgrad, dweight)


@pytest.mark.multirank
def test_ring_sends_per_layer_and_their_bytes(ring4):
    """cp4 ring: per layer, cp-1 packed K|V sends forward; backward cp-1 K|V and cp dK|dV sends
    (the last one takes each block's gradient home), all to the next rank on axis 'cp'."""
    spec, plan = PRESETS[LLAMA], Plan(**COMM_PLAN)
    cp, layers = plan.cp, spec.num_layers
    rows = plan.batch_size  # cp ranks share the batch rows (data parallel 1)
    kv = (rows * (plan.seq_len // cp) * spec.width("kv")) * 2  # K and V of one block: elements
    for rank, result in enumerate(ring4):
        sends = [c for c in result["comms"] if c.op == "send"]
        recvs = [c for c in result["comms"] if c.op == "recv"]
        assert {c.axis for c in sends + recvs} == {"cp"}, rank
        assert {c.peer for c in sends} == {(rank + 1) % cp} and {c.peer for c in recvs} == {(rank - 1) % cp}
        kv_bytes, grad_bytes = kv * 4, kv * 4  # fp32 blocks; the gradient travels in fp32
        # forward cp-1 K|V hops; backward cp-1 K|V hops and cp dK|dV hops; per layer
        want = layers * ((cp - 1) + (cp - 1) + cp)
        assert len(sends) == len(recvs) == want, (rank, len(sends), want)
        assert sum(c.bytes for c in sends) == layers * (2 * (cp - 1) * kv_bytes + cp * grad_bytes)
        predicted = {(e.op, e.axis): (e.count, e.bytes) for e in predict_comms(spec, plan, rank)}
        assert predicted[("send", "cp")] == (len(sends), sum(c.bytes for c in sends)), rank
        assert predicted[("recv", "cp")] == (len(recvs), sum(c.bytes for c in recvs)), rank


@pytest.mark.multirank
def test_ring_rounds_read_from_the_ledger(ring4):
    """viz.ring_rounds: in round i rank r holds rank (r - i) mod cp's block, one block's bytes in."""
    from interactive_parallel import viz

    comms = [c for result in ring4 for c in result["comms"]]
    rounds = viz.ring_rounds(comms)
    cp, spec, plan = 4, PRESETS[LLAMA], Plan(**COMM_PLAN)
    block = 2 * plan.batch_size * (plan.seq_len // cp) * spec.width("kv") * 4
    assert rounds == {r: [((r - i) % cp, block if i else 0) for i in range(cp)] for r in range(cp)}
    assert len(viz.ring_rounds_figure(comms).data[0].z) == cp


@pytest.mark.pure
def test_ring_rounds_empty_without_ring_records():
    from interactive_parallel import viz
    from interactive_parallel.records import CommRecord

    assert viz.ring_rounds([CommRecord(rank=0, step=0, op="all_gather", bytes=8, axis="cp")]) == {}
    assert not viz.ring_rounds_figure(None).data
