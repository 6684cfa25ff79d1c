"""Multi-rank runtime features beyond training parity: generation, hot re-plan, checkpoints, verify.

Generation (KV-cached): greedy completions under every plan and combination equal
transformers' own `model.generate` on a one-process copy of the same weights (both
families, a left-padded batch of prompts of different lengths), and every rank returns the
same completions (sampled too). Each TP rank caches its own heads and each pipeline stage
its own layers (the KV bytes each rank reports say so); decoding steps under TP and PP
carry their communication from the comm ledger.
Hot re-plan: logits before and after moving dp2xtp2 -> pp2xtp2 match (LOGIT_TOL).
Checkpoint: saved under tp2xdp2, loaded under pp2xdp2 after the weights were changed,
the logits are those at save time (LOGIT_TOL). api.verify() reports ok under both plans,
and under dp2xtp2 with bf16 autocast (runtime.training.verify.TOLERANCE['bf16']).
"""
from __future__ import annotations

import pytest

from interactive_parallel.records import ParamDiff, VerifyReport

from mp_harness import run_ranks
import parity_workers as W

pytestmark = pytest.mark.multirank

LOGIT_TOL = 1e-5
COLLECTIVE_TIMEOUT_S = 45.0
NEW_TOKENS = 6
GEN_PLANS = [dict(tp=2), dict(pp=2), dict(tp=2, sequence_parallel=True), dict(fsdp=2), dict(cp=2),
             dict(pp=2, pp_schedule="interleaved-1f1b"), dict(tp=2, loss_parallel=True), dict(pp=2, pp_schedule="zbv")]


@pytest.fixture(scope="module")
def generated():
    return run_ranks(W.generate_group, 2, GEN_PLANS, NEW_TOKENS, collective_timeout_s=COLLECTIVE_TIMEOUT_S)


def test_generation_matches_transformers_generate(generated):
    ref = W.reference_generate(NEW_TOKENS)
    for label in ("tp2", "pp2", "tp2-sp"):
        for rank, per_rank in enumerate(generated):
            got = per_rank[label]["greedy"]
            assert [got[i] for i in range(len(W.PROMPTS))] == ref, f"{label} rank {rank}: {got} vs {ref}"


def test_loss_parallel_generation_picks_the_same_greedy_tokens(generated):
    """The head's logits split on the vocabulary: the last position's are gathered before the
    pick (runtime.inference.decode), so greedy tokens are tp2's and transformers' own."""
    ref = W.reference_generate(NEW_TOKENS)
    for per_rank in generated:
        got = per_rank["tp2 loss-parallel"]["greedy"]
        assert got == per_rank["tp2"]["greedy"]
        assert [got[i] for i in range(len(W.PROMPTS))] == ref


def test_data_parallel_generation_splits_prompts_and_matches(generated):
    """Under fsdp the ranks share out the prompts (and stay in step for the all-gathers)."""
    ref = W.reference_generate(NEW_TOKENS)
    merged = {**generated[0]["fsdp2"]["greedy"], **generated[1]["fsdp2"]["greedy"]}
    assert [merged[i] for i in range(len(W.PROMPTS))] == ref
    assert len(generated[0]["fsdp2"]["greedy"]) == 2 and len(generated[1]["fsdp2"]["greedy"]) == 1


def test_cp_and_interleaved_pp_generation_match(generated):
    """pp2 zbv: the stages a V lays out (rank 0 holds the first and the last), the hidden states
    sent back down to rank 0 and handed on within rank 1 (runtime.parallel.pp.pipeline_forward)."""
    ref = W.reference_generate(NEW_TOKENS)
    for label in ("cp2", "pp2-interleaved", "pp2 zbv"):
        for per_rank in generated:
            got = per_rank[label]["greedy"]
            assert [got[i] for i in range(len(W.PROMPTS))] == ref, label


def test_tied_weights_in_both_ends_of_a_v_with_data_parallel_refused():
    from interactive_parallel.plan import Plan
    from interactive_parallel.runtime.groups.mesh import tie_group

    with pytest.raises(ValueError, match=r"'zbv' with dp\(2\) \* fsdp\(1\) = 2"):
        tie_group(Plan(pp=2, dp=2, pp_schedule="zbv"), True, 0)
    assert tie_group(Plan(pp=2, pp_schedule="dualpipev", microbatches=4), True, 0) is None  # both ends on rank 0


def test_every_rank_gets_the_same_completions(generated):
    for label in generated[0]:
        if label == "fsdp2":
            continue
        assert generated[0][label]["sampled"] == generated[1][label]["sampled"], label
        assert generated[0][label]["greedy"] == generated[1][label]["greedy"], label


def test_mesh_sub_groups_inherit_the_collective_timeout(generated):
    """DeviceMesh sub-groups otherwise get torch's 30-minute default (see notes)."""
    for label, r in generated[0].items():
        assert r["timeouts"] and all(t == COLLECTIVE_TIMEOUT_S for t in r["timeouts"]), (label, r["timeouts"])


def test_sequence_parallel_shards_the_norms(generated):
    assert generated[0]["tp2-sp"]["norm_type"] == "DTensor"
    assert generated[0]["tp2"]["norm_type"] == "Parameter"


def test_each_rank_caches_its_own_heads_or_layers(generated):
    """KV bytes after the last step: TP halves the heads, PP the layers, CP keeps the whole
    sequence on every rank (its prompt forward ran split, the cache holds what it gathered)."""
    last = {label: per_rank["steps"][-1].kv_bytes for label, per_rank in generated[0].items()}
    assert last["tp2"] > 0 and last["tp2"] == last["pp2"] == last["tp2-sp"], last
    assert last["cp2"] == 2 * last["tp2"], last


def test_decoding_steps_carry_their_communication(generated):
    for label in ("tp2", "pp2"):
        steps = generated[0][label]["steps"]
        assert [s.step for s in steps] == list(range(NEW_TOKENS)) and steps[0].phase == "prefill"
        assert all(s.comm_ops > 0 and 0 < s.comm_s <= s.time_s for s in steps), label


ORACLE_PLANS_2 = [dict(dp=2), dict(fsdp=2), dict(tp=2), dict(tp=2, sequence_parallel=True),
                  dict(pp=2, microbatches=2), dict(pp=2, pp_schedule="interleaved-1f1b", microbatches=2), dict(cp=2)]
ORACLE_PLANS_4 = [dict(dp=2, tp=2), dict(pp=2, dp=2), dict(pp=2, tp=2, microbatches=2), dict(cp=2, tp=2),
                  dict(fsdp=2, tp=2, sequence_parallel=True), dict(dp=2, cp=2)]
ORACLE_TOKENS = 12


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return {preset: W.spiky_model_dir(preset, str(base / preset)) for preset in ("tiny-llama", "tiny-gpt2")}


@pytest.fixture(scope="module")
def oracle(model_dirs):
    return {name: W.hf_generate_dir(path, W.PADDED_PROMPTS, ORACLE_TOKENS) for name, path in model_dirs.items()}


def _check_oracle(got: dict, oracle: dict) -> None:
    wrong = {key: texts for key, texts in got.items() if texts != oracle[key[0]]}
    assert got and not wrong, f"differ from transformers' generate {oracle}: {wrong}"


def test_cached_generation_equals_transformers_generate_on_2_ranks(model_dirs, oracle):
    got = run_ranks(W.oracle_group, 2, model_dirs, ORACLE_PLANS_2, ORACLE_TOKENS,
                    collective_timeout_s=COLLECTIVE_TIMEOUT_S)[0]
    assert len(got) == 2 * len(ORACLE_PLANS_2)
    _check_oracle(got, oracle)


def test_cached_generation_equals_transformers_generate_in_combinations(model_dirs, oracle):
    got = run_ranks(W.oracle_group, 4, model_dirs, ORACLE_PLANS_4, ORACLE_TOKENS,
                    collective_timeout_s=COLLECTIVE_TIMEOUT_S)[0]
    assert len(got) == 2 * len(ORACLE_PLANS_4)
    _check_oracle(got, oracle)


SCENARIOS = [("tiny-llama", dict(dp=2, tp=2), dict(pp=2, tp=2), dict(pp=2, dp=2)),
             ("tiny-gpt2", dict(dp=2, tp=2), dict(pp=2, tp=2), dict(pp=2, dp=2))]


@pytest.fixture(scope="module")
def replanned_all(tmp_path_factory):
    """One 4-rank group: per preset, save under the first plan, re-plan to the second, load under the third."""
    base = tmp_path_factory.mktemp("ckpt")
    scenarios = [(*s, str(base / s[0])) for s in SCENARIOS]
    return run_ranks(W.replan_groups, 4, scenarios, dict(dp=2, tp=2))


@pytest.fixture(params=[s[0] for s in SCENARIOS])
def replanned(request, replanned_all):
    return [per_rank[request.param] for per_rank in replanned_all]


def _max(a, b):
    return float((a - b).abs().max())


def test_hot_replan_keeps_the_model(replanned):
    r = replanned[0]
    assert _max(r["before"], r["replanned"]) <= LOGIT_TOL


def test_checkpoint_loads_under_another_plan(replanned):
    r = replanned[0]
    assert _max(r["before"], r["changed"]) > 1e-3, "the training step did not change the weights"
    assert _max(r["before"], r["loaded"]) <= LOGIT_TOL
    assert r["info"].plan == "pp2xdp2"


def test_verify_reports_parity(replanned):
    for rank, r in enumerate(replanned):
        v = r["verify"]
        assert v.ok, f"rank {rank}: dloss {v.dloss} max_grad_diff {v.max_grad_diff} tolerance {v.tolerance}"
        assert isinstance(v, VerifyReport) and v.params and all(isinstance(p, ParamDiff) for p in v.params)
        assert len(v.params) > 10 and all(p.max_abs_diff <= v.tolerance["grad"] for p in v.params)
    assert replanned[0]["verify_after"].ok
    assert replanned[0]["verify_resized"].ok, "after update_training changed batch and seq_len under pp"
    assert replanned[0]["verify"].loss_ref == pytest.approx(replanned[1]["verify"].loss_ref)


def test_verify_under_bf16_autocast(replanned_all):
    v = replanned_all[0]["bf16"]
    assert v.ok and v.tolerance == {"loss": 1e-2, "grad": 1e-2}, (v.dloss, v.max_grad_diff)
