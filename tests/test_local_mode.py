"""The one-process mode (runtime.client.local, LocalSession): every rank of a tensor-parallel plan
in the test's own process on torch's LocalTensorMode. Parity with one process is the oracle, with
tests/test_parallel_parity.py's tolerances (loss 1e-5, gradients 1e-5, weights after 3 AdamW steps
1e-4, absolute); the records are held to what spawned ranks report (conftest.parity_steps); every
plan the mode cannot run is refused before anything is built, naming the parallelism."""
from __future__ import annotations

import pytest

import parity_workers as W
from interactive_parallel import Plan, PlanError
from interactive_parallel.plan import PRESETS
from interactive_parallel.plan.local import local_problems
from test_parallel_parity import ALL, GRAD_TOL, LOSS_TOL, STEPS, WEIGHT_TOL

ACCEPTED = ["llama-tp2", "llama-tp2-sp", "llama-tp2-lp", "llama-tp2-sp-lp", "llama-tp4", "gpt2-tp2", "gpt2-tp2-lp"]
"""The parity plans (test_parallel_parity.ALL) the mode accepts."""


def local_run(preset: str, fields: dict, steps: int) -> dict:
    """train_and_grads's record of the same run in one process on LocalTensorMode."""
    from interactive_parallel.runtime.client.local import LocalRanks

    ranks = LocalRanks(W.as_spec(preset), Plan(**fields))
    try:
        records = ranks.train(steps)
        losses = [r.loss for r in records if r.rank == 0]
        assert all(r.loss == losses[r.step] for r in records), "every rank sees the same loss"
        weights = ranks.full_state_dict()
        loss, grads = ranks.full_grads()
    finally:
        ranks.close()
    return {"losses": losses + [loss], "grads": grads, "weights": weights}


@pytest.mark.rank1
@pytest.mark.parametrize("label", ["llama-tp2-sp-lp", "llama-tp4", "gpt2-tp2"])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_local_mode_matches_one_process(label, clip):
    """3 AdamW steps of every rank in one process: losses, the next batch's gradients and the weights
    equal the one-process reference's (sequence and loss parallel, four ranks, GPT-2's tied and
    transposed weights, whose gradients LocalTensorMode nests; with gradient clipping too)."""
    preset, fields = ALL[label]
    fields = {**fields, "max_grad_norm": clip}
    W.assert_parity(local_run(preset, fields, STEPS), W.reference(preset, fields, STEPS),
                    (LOSS_TOL, GRAD_TOL, WEIGHT_TOL), label)


@pytest.mark.rank1
def test_local_mode_matches_one_process_under_bf16():
    """bf16 autocast on every rank in one process against one process under it too, at verify()'s
    bf16 bound (1e-2: rounding to 8 mantissa bits), sequence and loss parallel included."""
    from interactive_parallel.runtime.training.verify import TOLERANCE

    preset, fields = ALL["llama-tp2-sp-lp"]
    fields = {**fields, "precision": "bf16"}
    tol = TOLERANCE["bf16"]
    W.assert_parity(local_run(preset, fields, STEPS), W.reference(preset, fields, STEPS),
                    (tol["loss"], tol["grad"], tol["grad"]), "llama-tp2-sp-lp-bf16")


@pytest.mark.rank1
def test_local_mode_matches_one_process_with_experts():
    """A mixture of experts whose experts are not split (Mixtral, tp2): the same three-way parity."""
    from moe_workers import spec_of

    spec = spec_of("mixtral")
    W.assert_parity(local_run(spec, dict(tp=2), STEPS), W.reference(spec, dict(tp=2), STEPS),
                    (LOSS_TOL, GRAD_TOL, WEIGHT_TOL), "mixtral-tp2")


@pytest.mark.multirank  # its oracle, conftest.parity_steps, comes from spawned ranks (shared with test_dryrun)
def test_local_mode_records_equal_spawned_ranks(parity_steps):
    """One step of tp2 with sequence parallel in one process: every rank's memory record, comm
    ledger (its collectives per group and axis) and shard records are what spawned gloo ranks report."""
    from interactive_parallel.runtime.client.local import LocalRanks
    from test_dryrun import _per_rank, _shard_key

    for label in ("llama-tp2-sp", "llama-tp2-lp"):
        preset, fields = ALL[label]
        ranks = LocalRanks(PRESETS[preset], Plan(**fields))
        try:
            ranks.train(1)
            got = ranks.records()
        finally:
            ranks.close()
        for rank, (memory, comms, shards) in parity_steps[label, "fp32"].items():
            mine = got.memory()[rank]
            assert (mine.params, mine.grads, mine.optimizer, mine.activations) == \
                (memory.params, memory.grads, memory.optimizer, memory.activations), (label, rank)
            assert _per_rank(got.comms(rank)).get(rank, {}) == _per_rank(comms).get(rank, {}), (label, rank)
            assert sorted(map(_shard_key, got.layout(rank=rank))) == sorted(map(_shard_key, shards)), (label, rank)


REFUSED = [
    (dict(dp=2), "dp(2): data parallel (DDP)"), (dict(fsdp=2), "fsdp(2): FSDP2 resizes parameter storage"),
    (dict(pp=2), "pp(2): pipeline stages"), (dict(cp=2), "cp(2): context parallel"),
    (dict(dp=2, ep=2), "ep(2): expert parallel"), (dict(tp=2, compile=True), "compile=True"),
    (dict(tp=2, recompute="full"), "recompute='full'"), (dict(tp=2, precision="fp16"), "precision='fp16'"),
]


@pytest.mark.pure
@pytest.mark.parametrize("fields,message", REFUSED, ids=[m.split(":")[0] for _, m in REFUSED])
def test_refused_plans_name_the_parallelism_and_the_alternative(fields, message):
    problems = local_problems(Plan(**fields))
    assert any(message in p for p in problems), problems
    assert all("Session" in p for p in problems), problems
    assert local_problems(Plan(tp=4, sequence_parallel=True, loss_parallel=True)) == []


@pytest.mark.rank1
def test_local_session_runs_and_refuses_before_anything_is_built():
    """LocalSession answers a lesson's calls and leaves no process group at stop; a refused plan
    raises PlanError before the fake group or any tensor exists."""
    import torch.distributed as dist

    from interactive_parallel import LocalSession

    with LocalSession(ranks=2) as s:  # the calls a lesson makes, as of a Session
        s.apply(Plan(tp=2, batch_size=2, seq_len=16))
        assert [r.rank for r in s.train(1)] == [0, 1] and len(s.history) == 2
        assert {r.rank for r in s.layout()} == {0, 1} and len(s.memory()) == 2 and s.comms(1)
        s.check_layout()
    assert not dist.is_initialized()
    with pytest.raises(PlanError, match=r"fsdp\(2\).*Session"):
        LocalSession(ranks=2).apply(Plan(fsdp=2))
    with pytest.raises(PlanError, match=r"pp\(2\).*Session"):
        with LocalSession(ranks=2, model="tiny-gpt2") as s:
            s.apply(Plan(pp=2))
    assert not dist.is_initialized()
