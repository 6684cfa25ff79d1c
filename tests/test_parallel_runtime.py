"""Multi-rank runtime features beyond training parity: generation, hot re-plan, checkpoints, verify.

Generation: greedy completions under tp=2, pp=2 (and tp=2 with sequence parallel) equal
the single-process model's, and every rank returns the same completions (sampled too).
Hot re-plan: logits before and after moving dp2xtp2 -> pp2xtp2 match (LOGIT_TOL).
Checkpoint: saved under tp2xdp2, loaded under pp2xdp2 after the weights were changed,
the logits are those at save time (LOGIT_TOL). api.verify() reports ok under both plans.
"""
from __future__ import annotations

import pytest
import torch

from mp_harness import run_ranks
import parity_workers as W

pytestmark = pytest.mark.multirank

LOGIT_TOL = 1e-5
NEW_TOKENS = 6
GEN_PLANS = [dict(tp=2), dict(pp=2), dict(tp=2, sequence_parallel=True)]


@pytest.fixture(scope="module")
def generated():
    return run_ranks(W.generate_group, 2, GEN_PLANS, NEW_TOKENS)


def test_generation_matches_single_process(generated):
    ref = W.reference_generate(NEW_TOKENS)
    for label in ("tp2", "pp2", "tp2-sp"):
        for rank, per_rank in enumerate(generated):
            got = per_rank[label]["greedy"]
            assert [got[i] for i in range(len(W.PROMPTS))] == ref, f"{label} rank {rank}: {got} vs {ref}"


def test_every_rank_gets_the_same_completions(generated):
    for label in generated[0]:
        assert generated[0][label]["sampled"] == generated[1][label]["sampled"], label
        assert generated[0][label]["greedy"] == generated[1][label]["greedy"], label


def test_sequence_parallel_shards_the_norms(generated):
    assert generated[0]["tp2-sp"]["norm_type"] == "DTensor"
    assert generated[0]["tp2"]["norm_type"] == "Parameter"


@pytest.fixture(scope="module", params=[("tiny-llama", dict(dp=2, tp=2), dict(pp=2, tp=2), dict(pp=2, dp=2)),
                                        ("tiny-gpt2", dict(dp=2, tp=2), dict(pp=2, tp=2), dict(pp=2, dp=2))],
                ids=["llama", "gpt2"])
def replanned(request, tmp_path_factory):
    """Save under the first plan, re-plan to the second, load under the third."""
    preset, save_plan, replan, load_plan = request.param
    path = str(tmp_path_factory.mktemp("ckpt") / "step1")
    return run_ranks(W.replan_group, 4, preset, save_plan, replan, load_plan, path)


def _max(a, b):
    return float((a - b).abs().max())


def test_hot_replan_keeps_the_model(replanned):
    r = replanned[0]
    assert _max(r["before"], r["replanned"]) <= LOGIT_TOL


def test_checkpoint_loads_under_another_plan(replanned):
    r = replanned[0]
    assert _max(r["before"], r["changed"]) > 1e-3, "the training step did not change the weights"
    assert _max(r["before"], r["loaded"]) <= LOGIT_TOL
    assert r["info"]["plan"] == "pp2xdp2"


def test_verify_reports_parity(replanned):
    for rank, r in enumerate(replanned):
        v = r["verify"]
        assert v["ok"], f"rank {rank}: {({k: v[k] for k in ('dloss', 'max_grad_diff', 'tolerance')})}"
        assert set(v) >= {"ok", "tolerance", "loss_ref", "loss_par", "dloss", "params"}
        assert all(set(p) == {"name", "max_abs_diff", "shape"} for p in v["params"])
    assert replanned[0]["verify_after"]["ok"]
    assert replanned[0]["verify"]["loss_ref"] == pytest.approx(replanned[1]["verify"]["loss_ref"])
