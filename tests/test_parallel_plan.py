"""Validation rules of the parallel layouts (pure: no torch.distributed)."""
from __future__ import annotations

import pytest

from interactive_parallel.plan import PRESETS, Plan, validate

pytestmark = pytest.mark.pure

LLAMA = PRESETS["tiny-llama"]


def problems(world: int, **fields) -> list[str]:
    return validate(Plan(**fields), world, LLAMA)


def test_every_axis_is_supported_now():
    for fields in (dict(dp=4), dict(fsdp=4), dict(tp=4), dict(pp=4), dict(cp=2, dp=2), dict(dp=2, pp=2, tp=2)):
        world = Plan(**fields).world_size
        assert problems(world, **fields) == [], fields


def test_heads_not_divisible_by_tp():
    got = problems(8, tp=8)
    assert "tp(8) does not divide num_attention_heads(4)" in got
    assert "tp(8) does not divide num_key_value_heads(4)" in got


def test_interleaved_needs_layers_divisible_by_stages():
    got = problems(4, pp=4, pp_schedule="interleaved-1f1b", virtual_stages=2)
    assert any("pp(4) * virtual_stages(2) = 8" in p and "num_hidden_layers(4)" in p for p in got), got


def test_interleaved_needs_two_virtual_stages_and_microbatches_multiple_of_its_rounds():
    assert any("virtual_stages(1) >= 2" in p for p in problems(2, pp=2, pp_schedule="interleaved-1f1b",
                                                                 virtual_stages=1))
    # torch runs max(1, m // pp) rounds: 3 microbatches at pp 2 are one round (ran at parity), 5 are two
    assert problems(2, pp=2, pp_schedule="interleaved-1f1b", microbatches=3, batch_size=6) == []
    got = problems(2, pp=2, pp_schedule="interleaved-1f1b", microbatches=5, batch_size=10)
    assert any("microbatches(5)" in p and "pp(2)" in p and "= 2" in p for p in got), got


@pytest.mark.parametrize("name,m,ok", [
    ("interleaved-zb", 1, True), ("interleaved-zb", 3, True), ("interleaved-zb", 4, True),
    ("interleaved-zb", 5, False), ("interleaved-zb", 6, True),
    ("zbv", 1, True), ("zbv", 2, True), ("zbv", 5, True),
    ("dualpipev", 3, False), ("dualpipev", 4, True), ("dualpipev", 5, True)])
def test_zero_bubble_microbatch_rules_are_torchs(name, m, ok):
    got = problems(2, pp=2, pp_schedule=name, microbatches=m, batch_size=4 * m)
    assert (got == []) == ok, got
    if not ok:
        assert any(f"microbatches({m})" in p and name in p for p in got), got


def test_zero_bubble_stage_layouts():
    v = Plan(pp=2, pp_schedule="zbv")
    assert (v.n_stages, v.stage_ids(0), v.stage_ids(1), v.zero_bubble) == (4, [0, 3], [1, 2], True)
    assert [v.stage_owner(s) for s in range(4)] == [0, 1, 1, 0]
    looped = Plan(pp=2, pp_schedule="interleaved-zb", virtual_stages=1)
    assert problems(2, pp=2, pp_schedule="interleaved-zb", virtual_stages=1) == []  # torch runs it (measured)
    assert looped.n_stages == 2
    assert Plan(pp=2, pp_schedule="ZBVZeroBubble").pp_schedule == "zbv"
    assert Plan(pp=2, pp_schedule="dualpipev", microbatches=4).describe() == "pp2 dualpipev"
    assert any("dualpipev" in p and "(4)" in p for p in problems(4, pp=4, pp_schedule="dualpipev", microbatches=4))


def test_1f1b_needs_a_microbatch_per_stage():
    assert any("microbatches(2) >= pp(4)" in p for p in problems(4, pp=4, microbatches=2))


def test_microbatches_must_divide_the_per_rank_batch():
    got = problems(4, pp=2, dp=2, microbatches=3)
    assert any("per-rank micro-batch 4" in p and "microbatches(3)" in p for p in got), got


def test_seq_len_by_twice_cp_and_by_tp_under_sequence_parallel():
    assert any("2 * cp(2) = 4" in p for p in problems(2, cp=2, seq_len=30))
    assert any("seq_len(30)" in p and "tp(4)" in p for p in problems(4, tp=4, seq_len=30, sequence_parallel=True))
    assert problems(4, tp=2, cp=2, seq_len=36, sequence_parallel=True) == []
    assert any("tp(2) * cp(2) = 4" in p for p in problems(4, tp=2, cp=2, seq_len=18, sequence_parallel=True))


def test_cp_with_pp_is_refused():
    assert any("cp(2) with pp(2)" in p for p in problems(4, cp=2, pp=2))
