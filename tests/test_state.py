"""Training state across plans, checkpoints and one-rank references (spawned gloo ranks).

- Re-plan keeps the training: 3 AdamW steps under one plan, re-plan, 3 more equal 6 steps
  under either plan alone (global loss within LOSS_TOL = 1e-5, the parity tolerance): the
  weights, AdamW's moments and step count all carry (a fresh AdamW differs by ~2e-2 at the
  5th step, see notes). tiny-llama dp4 -> dp2xtp2, fsdp4 -> pp2xdp2, tp4 -> fsdp2xcp2, and
  tiny-gpt2 (fused q|k|v stored permuted under TP) dp2xtp2 -> fsdp2xtp2 -> tp4 -> pp2xtp2.
- Checkpoints hold the optimizer and step: saved under one plan, loaded under another, the
  next steps' losses equal those after the save (LOSS_TOL); a checkpoint of another model
  is refused naming its parameters, and the ranks keep their weights and step.
- verify() builds its reference on rank 0 and every rank gets its report; told that rank 0
  has 1 MiB, it returns a report that says so with the numbers.
- Load memory: peak RSS per rank laying out a 60 M-parameter Llama under fsdp=4, beyond
  the RSS before the load, is <= 0.35 x the model's fp32 bytes (a rank holds a quarter).
"""
from __future__ import annotations

import pytest

from mp_harness import run_ranks
import state_workers as S

pytestmark = pytest.mark.multirank

LOSS_TOL = 1e-5
STEPS = 3
LLAMA_PAIRS = [(dict(dp=4), dict(dp=2, tp=2)), (dict(fsdp=4), dict(pp=2, dp=2)), (dict(tp=4), dict(fsdp=2, cp=2))]
GPT2_PAIRS = [(dict(dp=2, tp=2), dict(fsdp=2, tp=2)), (dict(fsdp=2, tp=2), dict(tp=4)), (dict(tp=4), dict(pp=2, tp=2))]
LOAD_RSS_FACTOR = 0.35
RSS_CONFIG = dict(model_type="llama", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                  tie_word_embeddings=False)
RSS_WARM = dict(RSS_CONFIG, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2)


def _params(config: dict) -> int:
    from interactive_parallel.plan.estimate import param_inventory
    from interactive_parallel.plan.models import spec_from_config_dict
    import math

    return sum(math.prod(p.shape) for p in param_inventory(spec_from_config_dict(config)))


@pytest.fixture(scope="module")
def continued(tmp_path_factory):
    base = tmp_path_factory.mktemp("replan")
    out = run_ranks(S.continued_runs, 4, "tiny-llama", LLAMA_PAIRS, STEPS, str(base / "llama"))[0]
    out.update(run_ranks(S.continued_runs, 4, "tiny-gpt2", GPT2_PAIRS, STEPS, str(base / "gpt2"))[0])
    return out


@pytest.mark.parametrize("pair", LLAMA_PAIRS + GPT2_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_replan_carries_weights_optimizer_and_step(continued, pair):
    from interactive_parallel.plan import Plan
    from interactive_parallel.records import RestoreSource

    label = f"{Plan(**pair[0]).describe()}->{Plan(**pair[1]).describe()}"
    r = continued[label]
    assert r["state"] is RestoreSource.CARRIED and r["step"] == STEPS
    for alone in ("a", "b"):
        worst = max(abs(x - y) for x, y in zip(r["replanned"], r[alone]))
        assert len(r["replanned"]) == 2 * STEPS and worst <= LOSS_TOL, (label, alone, r["replanned"], r[alone])


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    other = str(base / "gpt2")
    run_ranks(S.save_other_model, 2, "tiny-gpt2", other)
    return run_ranks(S.checkpoint_round_trip, 4, "tiny-llama", dict(fsdp=2, tp=2), dict(pp=2, dp=2), STEPS,
                     str(base / "llama"), other)[0]


def test_checkpoint_carries_optimizer_and_step_across_plans(round_trip):
    from interactive_parallel.records import SaveInfo

    r = round_trip
    saved, loaded = r["info_save"], r["info_load"]
    assert isinstance(saved, SaveInfo) and isinstance(loaded, SaveInfo)
    assert saved.optimizer and saved.step == STEPS
    assert loaded.optimizer and loaded.step == STEPS and loaded.plan == "pp2xdp2"
    worst = max(abs(x - y) for x, y in zip(r["after_save"], r["after_load"]))
    assert worst <= LOSS_TOL, (r["after_save"], r["after_load"])


def test_checkpoint_of_another_model_is_refused_and_changes_nothing(round_trip):
    text = round_trip["refused"]
    assert "model.embed_tokens.weight: missing from the checkpoint (model has [128, 64])" in text, text
    assert "transformer.wte.weight: in the checkpoint ([128, 64]), not in the model" in text, text
    assert "more missing from the checkpoint" in text and "more not in the model" in text, text
    assert round_trip["unchanged"]


@pytest.mark.parametrize("preset,fields", [("tiny-gpt2", dict(pp=2, tp=2)), ("tiny-llama", dict(fsdp=2, cp=2))])
def test_verify_runs_on_rank_0_and_refuses_with_numbers(preset, fields):
    reports = run_ranks(S.verify_on_one_rank, 4, preset, fields)
    assert all(r["ok"] == reports[0]["ok"] for r in reports)  # rank 0's report, broadcast
    ok = reports[0]["ok"]
    assert ok.ok and ok.params and not ok.note, (ok.dloss, ok.max_grad_diff)
    refused = reports[0]["refused"]
    assert not refused.ok and "MiB on rank 0" in refused.note and "1 MiB available" in refused.note, refused.note
    assert "not run" in str(refused)


def test_loading_holds_a_shard_not_the_model():
    results = run_ranks(S.load_peak_rss, 4, RSS_CONFIG, dict(fsdp=4), RSS_WARM, timeout_s=600)
    model_bytes = 4 * _params(RSS_CONFIG)
    for r in results:
        grew = r["peak"] - r["before"]
        print(f"rank {r['rank']}: peak - before = {grew / 2**20:.1f} MiB = {grew / model_bytes:.3f} x "
              f"the model's {model_bytes / 2**20:.0f} MiB")
        assert grew <= LOAD_RSS_FACTOR * model_bytes, (r, model_bytes)
