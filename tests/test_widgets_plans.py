"""The panel's "Which plan?" page (widgets/whichplan.py) against the fake session: Calibrate,
Search, the sortable table and its figure, Apply and Dry run of a row, and the applied plan's
prediction against its measured steps as they arrive. The predictions are the real plan/steptime
and plan/search (the fake's calls are), so what the page shows is checked against them."""
from __future__ import annotations

import html
import math
import re
import time

import pytest
from fake_session import WORLD, FakeSession

from interactive_parallel import viz
from interactive_parallel.plan import Plan
from interactive_parallel.plan.hardware import PROFILES
from interactive_parallel.records import HardwareProfile, StepPrediction
from interactive_parallel.viz.plans import SPLIT_COLORS, UNFIT_COLOR, shares
from interactive_parallel.widgets import Panel
from interactive_parallel.widgets import cluster as cluster_mod
from interactive_parallel.widgets.fit import FitFigures
from interactive_parallel.widgets.whichplan import BAR_PX, CALIBRATED, GiB

pytestmark = pytest.mark.pure


def shown(widget) -> str:
    """An HTML widget's text as a reader sees it (tags dropped, entities decoded, spaces folded)."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", widget.value)).split())


def until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def laid_out(**kw) -> tuple[FakeSession, Panel]:
    s = FakeSession(**kw)
    s.load_model("tiny-llama")
    s.apply(Plan(dp=WORLD))
    return s, Panel(s)


def open_plans(p: Panel):
    p.views.tab.selected_index = p.views.tab.titles.index("plans")
    return p.which_plan


def searched(s: FakeSession) -> list[tuple]:
    return [c for c in s.calls if c[0] == "search_plans"]


def row_labels(w) -> list[str]:
    """The plan button of each table row, in the order shown."""
    return [c.description for c in w.table.widget.children if "ip-plans-row" in c._dom_classes]


def test_the_page_is_a_views_tab_with_its_controls_and_fitted_figures():
    s, p = laid_out()
    w = open_plans(p)
    assert w.widget in p.views.pages["plans"].children
    classes = {c for x in _widgets(w.widget) for c in getattr(x, "_dom_classes", ())}
    assert {"ip-plans-profile", "ip-calibrate-button", "ip-plans-memory", "ip-plans-world", "ip-search-plans-button",
            "ip-plans-table", "ip-plans-figure", "ip-apply-plan-button", "ip-dry-run-plan-button",
            "ip-step-time-figure", "ip-plans-sort-seconds", "ip-plans-sort-tokens-per-s"} <= classes
    fit = next(x for x in p.children if isinstance(x, FitFigures))
    assert {"ip-plans-figure", "ip-step-time-figure"} <= set(fit.figures)
    assert w.profile.options == tuple(PROFILES) and w.profile.value == "cpu" and w.world.value == WORLD
    assert w.apply.disabled and w.dry_run.disabled and not w.search.disabled  # nothing selected yet
    # opened: the applied plan's prediction, before any step
    assert ("predict_step", None, "cpu") in s.calls
    line = w.step_time.data[0]
    assert line.mode == "lines" and "Train to measure" in shown(p.views.messages["plans"])
    assert line.y[0] == pytest.approx(s.predict_step().seconds * 1e3)  # a tiny model's step, in ms
    assert "dp4 on cpu" in w.step_time.layout.title.text.replace("<br>", " ")


def _widgets(w) -> list:
    return [w] + [x for c in getattr(w, "children", ()) or () for x in _widgets(c)]


def test_search_asks_the_session_and_the_table_and_figure_show_its_ranking():
    s, p = laid_out()
    w = open_plans(p)
    w.memory.value, w.world.value = 0.5, 8
    p.plan_section.fields["seq_len"].value = 32  # the edited plan's work per step is held fixed
    w.search.click()
    assert p.error_text == ""
    assert searched(s) == [("search_plans", "cpu", dict(memory_per_rank=GiB // 2, world=8, top=20, batch_size=8,
                                                         seq_len=32))]
    found = w.results
    assert found and all(isinstance(r, StepPrediction) and r.fits for r in found)
    assert [r.tokens_per_s for r in found] == sorted((r.tokens_per_s for r in found), reverse=True)
    assert row_labels(w) == [f"{i}. {r.plan}" for i, r in enumerate(found, 1)]
    bars = w.figure.data
    assert [t.name for t in bars] == ["compute", "communication", "bubble"]
    assert list(bars[0].y) == [f"{i}. {r.plan}" for i, r in enumerate(found, 1)]
    for i, r in enumerate(found):
        assert math.isclose(sum(t.x[i] for t in bars) / 1e3, r.seconds, rel_tol=1e-9)  # ms on the axis
    status = shown(w.status)
    assert f"{len(found)} plans on 8 ranks" in status and f"best {found[0].plan}" in status
    assert "batch 8 x seq 32" in status
    # each row's bar: a span per part, as wide as its share, in the figure's colours
    first = next(c for c in w.table.widget.children if "ip-plan-bar" in getattr(c, "value", ""))
    for part, share in shares(found[0]).items():
        assert f"width:{share * BAR_PX:.1f}px;background:{SPLIT_COLORS[part]}" in first.value


def test_a_header_click_sorts_the_rows_and_a_second_click_reverses():
    s, p = laid_out()
    w = open_plans(p)
    w.search.click()
    found = w.results
    assert len(found) >= 3

    def by(key, reverse=False) -> list[str]:
        order = sorted(range(len(found)), key=lambda i: key(found[i]), reverse=reverse)
        return [f"{i + 1}. {found[i].plan}" for i in order]

    w.table.headers["seconds"].click()
    assert row_labels(w) == by(lambda r: r.seconds) and w.table.headers["seconds"].description == "step ▲"
    w.table.headers["seconds"].click()
    assert row_labels(w) == by(lambda r: r.seconds, reverse=True)
    w.table.headers["mfu"].click()  # more is better: largest first
    assert row_labels(w) == by(lambda r: r.mfu, reverse=True) and w.table.headers["mfu"].description == "MFU ▼"
    w.table.headers["memory"].click()
    assert row_labels(w) == by(lambda r: r.memory_bytes)
    w.table.headers["rank"].click()
    assert row_labels(w) == by(lambda r: -r.tokens_per_s)  # the search's own order back
    assert [c[0] for c in s.calls].count("search_plans") == 1  # sorting asks nothing


def test_apply_a_row_of_the_sessions_world_and_the_plan_section_shows_it():
    s, p = laid_out()
    w = open_plans(p)
    w.search.click()
    row = w.results[1]
    w.table.select(1)
    assert not w.apply.disabled and not w.dry_run.disabled and row.plan in shown(w.selection)
    w.apply.click()
    plan = Plan.from_dict(row.plan_fields).replace(device="cpu")
    assert p.error_text == "" and s.calls[[c[0] for c in s.calls].index("apply", 2)] == ("apply", plan)
    assert s.plan == plan and p.plan_section.plan() == plan and "applied" in shown(p.plan_section.messages)
    # the step-time figure now predicts the applied plan
    assert row.plan in w.step_time.layout.title.text.replace("<br>", " ")
    assert w.step_time.data[-1].y[0] == pytest.approx(s.predict_step(plan).seconds * 1e3)


def test_a_row_of_another_world_is_dry_run_not_applied():
    s, p = laid_out()
    w = open_plans(p)
    w.world.value = 8
    w.search.click()
    w.table.select(0)
    row = w.results[0]
    assert w.apply.disabled and not w.dry_run.disabled
    assert "Apply needs 8 ranks, the session has 4" in shown(w.selection)
    w.dry_run.click()
    plan = Plan.from_dict(row.plan_fields).replace(device="cpu")
    assert p.error_text == "" and ("dry_run", plan) in s.calls
    assert f"dry run of {plan.describe()} on 8 virtual ranks" in shown(w.selection)
    assert s.plan == Plan(dp=WORLD)  # the ranks were not touched


def test_calibrate_offers_the_calibrated_profile_and_search_uses_the_chosen_one():
    s, p = laid_out()
    w = open_plans(p)
    w.calibrate.click()
    assert p.error_text == "" and ("calibrate", None, 5) in s.calls
    assert isinstance(s.calibrated, HardwareProfile)
    assert w.profile.options[0] == CALIBRATED and w.profile.value == CALIBRATED and "calibrated" in shown(w.status)
    w.search.click()
    assert searched(s)[-1][1] is s.calibrated and {r.profile for r in w.results} == {s.calibrated.name}
    w.profile.value = "h100"  # the step-time line follows the chosen profile at once
    assert ("predict_step", None, "h100") in s.calls and "on h100" in w.step_time.layout.title.text
    w.search.click()
    assert searched(s)[-1][1] == "h100" and {r.profile for r in w.results} == {"h100"}
    assert "on h100" in w.figure.layout.title.text


def test_when_nothing_fits_the_refusal_is_shown_with_the_closest_plan_greyed():
    s, p = laid_out()
    w = open_plans(p)
    w.memory.value = 0.0001  # 100 KiB per rank: tiny-llama needs more on any layout
    w.search.click()
    assert "search plans failed" in p.error_text and "no layout of tiny-llama on 4 ranks fits" in p.error_text
    assert len(w.results) == 1 and not w.results[0].fits
    assert "does not fit" in " ".join(getattr(c, "value", "") for c in w.table.widget.children)
    assert set(w.figure.data[0].marker.color) == {UNFIT_COLOR} and "does not fit" in w.figure.layout.title.text
    assert not w.search.disabled  # the controls are back


def test_the_measured_steps_join_the_prediction_as_they_arrive():
    s, p = laid_out(step_delay=0.15)
    w = open_plans(p)
    p.views.live_interval = 0.0
    job = p.train(6)
    assert until(lambda: len(w.step_time.data) == 2 and len(w.step_time.data[0].x) >= 2)
    assert not job.done and w.search.disabled and w.calibrate.disabled  # drawn while training runs
    assert p.wait(10) and p.error_text == ""
    points, line = w.step_time.data
    expected = viz.step_times(s.history, "dp4")
    assert list(points.x) == [step for step, _ in expected] == list(range(6))
    assert list(points.y) == pytest.approx([t * 1e3 for _, t in expected])  # the fake's 10 ms steps
    assert list(line.x) == [0, 5] and "median" in w.step_time.layout.title.text.replace("<br>", " ")
    assert not w.search.disabled


def test_without_a_session_the_page_says_so_and_its_buttons_are_off(monkeypatch):
    monkeypatch.setattr(cluster_mod, "cuda_unavailable_reason", lambda session=None: "no GPU (test)")
    p = Panel(None)
    w = open_plans(p)
    assert "no session" in shown(p.views.messages["plans"]) and not w.step_time.data
    assert w.search.disabled and w.calibrate.disabled and w.apply.disabled and w.dry_run.disabled
    s = FakeSession(world=2)
    s.load_model("tiny-llama")
    p.set_session(s)
    assert w.world.value == 2 and not w.search.disabled
    w.search.click()
    assert p.error_text == "" and searched(s)[-1][2]["world"] == 2
