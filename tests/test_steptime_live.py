"""The step-time model against the live ranks: Session.calibrate, then predicted against measured
step time on every 4-rank parity plan of the classic layouts (dp, fsdp, tp, pp, cp and their
pairs), small-llama and tiny-llama, probes off; the session's search, and the panel's "Which
plan?" page driving the same calls. One live session for the module.

The bounds: the typical plan (the median of |predicted / measured - 1| over the plans but the
anchor, below) within TYPICAL = 25 %, and every plan within a factor of BOUND = 2.5 of its
measured median, both models.
On a quiet machine every plan has come within about 25 % in a round (the README, beside
bench/bench_steptime.py's rounds), but one plan's median moves by tens of percent with the
machine's load while the calibration may not follow it, so the per-plan bound catches a model
wrong in kind (a term missing, a unit off, a count per microbatch forgotten) and the typical one
a model off in degree.
Each calibration follows a run of dp4, the anchor: its measured steps give the profile the cost
of DDP's hooks and bookkeeping per step (replica_overhead_s, which the plans whose gradients
FSDP2's replicate averages carry too), so dp4's own gap is near 0 by construction and the other
ten are the predictions under test.
A plan outside its bound is measured once more. A round (calibrate, then measure every plan) that
misses a bound is followed by another, up to ROUNDS: a calibration taken while the machine was
quieter or busier than during the measurements skews every prediction one way (under a steady
load the calibration follows it; under a load that comes and goes it may not). The ratio is
asserted, never a wall-clock figure.
"""
from __future__ import annotations

import statistics

import pytest

from interactive_parallel import Plan
from interactive_parallel.records import HardwareProfile, StepPrediction
from interactive_parallel.viz import step_times
from interactive_parallel.widgets import Panel
from interactive_parallel.widgets.whichplan import CALIBRATED

pytestmark = pytest.mark.session

PLANS = {"dp4": dict(dp=4), "fsdp4": dict(fsdp=4), "tp4": dict(tp=4), "pp4": dict(pp=4),
         "dp2xtp2": dict(dp=2, tp=2), "fsdp2xtp2": dict(fsdp=2, tp=2), "dp2xfsdp2": dict(dp=2, fsdp=2),
         "pp2xtp2": dict(pp=2, tp=2), "pp2xdp2": dict(pp=2, dp=2), "cp2xdp2": dict(cp=2, dp=2),
         "cp2xtp2": dict(cp=2, tp=2)}
BATCH = dict(batch_size=8, seq_len=64)
ANCHOR = PLANS["dp4"]
"""The plan whose measured steps give the calibration its per-step cost (Session.calibrate)."""
BOUND = 2.5
TYPICAL = 0.25
ROUNDS = 3
WARMUP, STEPS = 2, 5


def _outside(gap: float) -> bool:
    return not 1 / BOUND <= 1 + gap <= BOUND


def _measured(s, plan: Plan) -> float:
    s.apply(plan)
    s.train(steps=WARMUP, snapshot_every=0)
    return statistics.median(t for _, t in step_times(s.train(steps=STEPS, snapshot_every=0)))


def _round(s) -> dict[str, float]:
    """Steps of the anchor plan, calibrate, then {plan name: predicted / measured - 1} for every plan."""
    _measured(s, Plan(**ANCHOR, **BATCH))
    profile = s.calibrate()
    assert isinstance(profile, HardwareProfile) and s.calibrated is profile
    assert profile.step_overhead_s >= 0 and profile.replica_overhead_s >= 0
    assert f"{STEPS + WARMUP - 1} measured steps of {Plan(**ANCHOR, **BATCH).describe()}" in profile.source
    gaps = {}
    for name, kw in PLANS.items():
        plan = Plan(**kw, **BATCH)
        predicted = s.predict_step(plan)
        assert isinstance(predicted, StepPrediction) and predicted.profile == profile.name
        measured = _measured(s, plan)
        if _outside(predicted.seconds / measured - 1):
            measured = _measured(s, plan)  # once more: a shared machine's load moves a median
        gaps[name] = predicted.seconds / measured - 1
    return gaps


def _misses(gaps: dict[str, float]) -> list[str]:
    outside = {n: f"{g:+.0%}" for n, g in gaps.items() if _outside(g)}
    typical = statistics.median(abs(g) for n, g in gaps.items() if PLANS[n] != ANCHOR)
    return ([f"outside a factor {BOUND}: {outside}"] if outside else []) + \
        ([f"the typical plan's gap {typical:.0%} > {TYPICAL:.0%}"] if typical > TYPICAL else [])


@pytest.mark.parametrize("model", ["small-llama", "tiny-llama"])
def test_the_calibrated_model_predicts_every_parity_plan(session4, model):
    s = session4
    s.set_probes(False)
    try:
        s.load_model(model)
        rounds = []
        for _ in range(ROUNDS):
            gaps = _round(s)
            rounds.append((_misses(gaps), {n: f"{g:+.0%}" for n, g in gaps.items()}))
            if not rounds[-1][0]:
                break
        assert not rounds[-1][0], f"{model}, {len(rounds)} rounds: " + "; ".join(
            f"round {i + 1}: {' and '.join(miss)} (all: {every})" for i, (miss, every) in enumerate(rounds))
        # the applied plan's prediction carries the measured median beside it
        applied = s.predict_step()
        assert applied.measured_s is not None and applied.measured_s > 0
    finally:
        s.set_probes(True)


def test_search_from_the_session_uses_its_model_and_rank_count(session4):
    s = session4
    s.load_model("tiny-llama")
    rows = s.search_plans(top=5)
    assert 0 < len(rows) <= 5 and all(Plan.from_dict(r.plan_fields).world_size == 4 for r in rows)
    best = Plan.from_dict(rows[0].plan_fields)
    s.apply(best)
    s.train(steps=1, snapshot_every=0)
    dry = s.dry_run(best)
    predicted = {m.rank: m.params + m.grads + m.optimizer for m in s.predict_memory(best)}
    assert {m.rank: m.params + m.grads + m.optimizer for m in dry.memory()} == predicted
    wider = s.search_plans("h100", world=64, batch_size=64, seq_len=256, top=3)
    assert all(Plan.from_dict(r.plan_fields).world_size == 64 for r in wider)


def test_the_page_calibrates_searches_applies_and_measures_a_live_session(session4):
    s = session4
    s.load_model("tiny-llama")
    p = Panel(s)
    p.views.tab.selected_index = p.views.tab.titles.index("plans")
    w = p.which_plan
    w.calibrate.click()
    assert p.error_text == "", p.error_text
    assert isinstance(s.calibrated, HardwareProfile) and w.profile.value == CALIBRATED
    w.search.click()
    assert p.error_text == "" and w.results and all(isinstance(r, StepPrediction) for r in w.results), p.error_text
    w.table.select(0)
    w.apply.click()
    plan = Plan.from_dict(w.results[0].plan_fields).replace(device=s.device)
    assert p.error_text == "" and s.plan == plan, p.error_text
    p.views.live_interval = 0.0
    p.train(3)
    assert p.wait(300) and p.error_text == "", p.error_text
    points, line = w.step_time.data
    assert len(points.x) == 3 and line.mode == "lines"
    assert line.y[0] == pytest.approx(s.predict_step().seconds * (1e3 if "(ms)" in w.step_time.layout.yaxis.title.text
                                                                 else 1.0))
    print("measured", [round(t, 4) for _, t in step_times(s.history, plan.describe())],
          "predicted", round(s.predict_step().seconds, 4), plan.describe())
