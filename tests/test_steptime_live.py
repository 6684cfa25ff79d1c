"""The step-time model on the live ranks: Session.calibrate after a run of the anchor plan, then a
prediction for every 4-rank parity plan of the classic layouts (dp, fsdp, tp, pp, cp and their
pairs), small-llama and tiny-llama, probes off; the session's search, and the panel's "Which
plan?" page driving the same calls. One live session for the module.

What is asserted holds on a machine of any speed or load: the profile comes back calibrated
and named, every plan's prediction is a positive split of compute, communication and bubble on
that profile, and the anchor's prediction is what its own recorded steps say it must be (the
model computed from recorded timings: dp4's measured median, by construction of the profile's
replica_overhead_s, unless the bare model already predicts more). How close the predictions
come to the live steps of the other plans depends on the machine and its load, and is a
benchmark: bench/bench_steptime.py measures every plan over rounds and prints the gaps (the
docs/planning.md's "Predicted against measured" shows them).
"""
from __future__ import annotations

import math
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
WARMUP, STEPS = 1, 3  # 3 steps after the first: what calibrate needs (ANCHOR_STEPS)


def _measured(s, plan: Plan) -> float:
    """The median of `plan`'s recorded steps after a warm-up (the slowest rank per step)."""
    s.apply(plan)
    s.train(steps=WARMUP, snapshot_every=0)
    return statistics.median(t for _, t in step_times(s.train(steps=STEPS, snapshot_every=0)))


@pytest.mark.parametrize("model", ["small-llama", "tiny-llama"])
def test_the_calibrated_model_predicts_every_parity_plan(session4, model):
    s = session4
    s.set_probes(False)
    try:
        s.load_model(model)
        anchor = Plan(**ANCHOR, **BATCH)
        _measured(s, anchor)
        profile = s.calibrate()
        assert isinstance(profile, HardwareProfile) and s.calibrated is profile
        assert profile.step_overhead_s >= 0 and profile.replica_overhead_s >= 0
        assert f"{STEPS + WARMUP - 1} measured steps of {anchor.describe()}" in profile.source
        # the anchor's steps as the session recorded them (its latest run, the first step left out)
        recorded = statistics.median(s.telemetry.run_times(anchor.describe()))
        predicted = s.predict_step(anchor)
        if profile.replica_overhead_s > 0:
            assert predicted.seconds == pytest.approx(recorded, rel=1e-9), (predicted.seconds, recorded)
        else:
            assert predicted.seconds >= recorded * (1 - 1e-9), (predicted.seconds, recorded)
        for name, kw in PLANS.items():
            p = s.predict_step(Plan(**kw, **BATCH))
            assert isinstance(p, StepPrediction) and p.profile == profile.name, name
            parts = (p.compute_s, p.comm_s, p.bubble_s)
            assert math.isfinite(p.seconds) and p.seconds > 0 and all(x >= 0 for x in parts), (name, p)
        # the applied plan's prediction carries the measured median beside it
        _measured(s, Plan(**PLANS["fsdp2xtp2"], **BATCH))
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
