"""viz/plans.py: ranked plans as stacked bars and a prediction against measured steps, from
hand-made StepPredictions (a 4-rank world; one plan does not fit its memory)."""
from __future__ import annotations

import math
import re

import pytest

from interactive_parallel.records import StepPrediction, StepRecord
from interactive_parallel.viz import TITLE_CHARS, plans_figure, predicted_vs_measured_figure, step_times
from interactive_parallel.viz.plans import SPLIT_COLORS, UNFIT_COLOR, UNFIT_MARK, parts, ranked, shares

pytestmark = pytest.mark.pure
GiB = 1024 ** 3


def pred(plan: str, compute: float, comm: float, bubble: float = 0.0, *, fits: bool = True, other: float = 0.0,
         profile: str = "h100") -> StepPrediction:
    seconds = compute + comm + bubble + other
    return StepPrediction(plan=plan, profile=profile, seconds=seconds, compute_s=compute, comm_s=comm,
                          bubble_s=bubble, tokens_per_s=4096 / seconds, mfu=0.4 * compute / seconds,
                          memory_bytes=(90 if not fits else 30) * GiB, fits=fits,
                          comm_by_axis={"dp": comm, "tp": 0.0}, rank=0, plan_fields={"dp": 4})


PREDS = [pred("fsdp4", 1.0, 0.5), pred("dp4", 1.0, 0.2, fits=False), pred("dp2xpp2", 1.0, 0.1, 0.4),
         pred("tp4", 1.0, 0.9)]
"""Ranked by tokens/s: dp4 (1.2 s, does not fit), fsdp4 (1.5 s), dp2xpp2 (1.5 s), tp4 (1.9 s)."""


def title_of(fig) -> list[str]:
    return re.sub(r"<(?!br>)[^>]+>", "", fig.layout.title.text).split("<br>")


def test_one_stacked_bar_per_plan_best_on_top_and_the_bars_sum_to_its_seconds():
    fig = plans_figure(PREDS)
    assert [t.name for t in fig.data] == ["compute", "communication", "bubble"]
    assert fig.layout.barmode == "stack" and all(t.orientation == "h" for t in fig.data)
    labels = list(fig.data[0].y)
    # the plans that fit first, fastest first; the one that does not fit last, marked
    assert labels == ["1. fsdp4", "2. dp2xpp2", "3. tp4", f"4. dp4{UNFIT_MARK}"]
    assert list(fig.layout.yaxis.categoryarray) == labels and fig.layout.yaxis.autorange == "reversed"
    order = ranked(PREDS)
    for i, p in enumerate(order):
        total = sum(t.x[i] for t in fig.data)
        assert math.isclose(total, p.seconds) and math.isclose(fig.data[1].x[i], p.comm_s)
    assert fig.data[2].x[1] == 0.4 and fig.data[2].x[0] == 0.0  # the bubble is the pipeline's alone
    assert fig.layout.xaxis.title.text == "predicted seconds per step (s)"
    assert all(len(line) <= TITLE_CHARS for line in title_of(fig)) and "on h100" in fig.layout.title.text
    assert "(1 does not fit, greyed)" in fig.layout.title.text


def test_plans_that_do_not_fit_are_greyed_and_the_hover_says_why():
    fig = plans_figure(PREDS)
    for trace in fig.data:
        colors = list(trace.marker.color)
        assert colors[:3] == [SPLIT_COLORS[trace.name]] * 3 and colors[3] == UNFIT_COLOR
    hover = fig.data[0].customdata[3][0]
    assert "90 GiB (does not fit)" in hover and "MFU" in hover and "tokens/s" in hover
    assert "dp 0.2 s" in hover and "tp" not in hover.split("axis:")[1]  # only axes that communicate


def test_top_keeps_the_best_and_a_small_step_reads_in_milliseconds():
    small = [pred(f"dp{i}", 0.001 * i, 0.0005) for i in range(1, 6)]
    fig = plans_figure(small, top=2)
    assert list(fig.data[0].y) == ["1. dp1", "2. dp2"] and "best 2 of 5" in fig.layout.title.text
    assert fig.layout.xaxis.title.text == "predicted seconds per step (ms)"
    assert math.isclose(fig.data[0].x[0] + fig.data[1].x[0], 1.5)


def test_seconds_the_split_leaves_out_are_drawn_as_other():
    p = pred("dp4", 1.0, 0.2, other=0.3)
    assert parts(p)["other"] == pytest.approx(0.3) and sum(shares(p).values()) == pytest.approx(1.0)
    fig = plans_figure([p, pred("tp4", 1.0, 0.9)])
    assert [t.name for t in fig.data] == ["compute", "communication", "bubble", "other"]
    assert sum(t.x[0] for t in fig.data) == pytest.approx(1.5) and fig.data[3].x[1] == 0.0


def test_no_plans_is_an_empty_state_and_other_records_are_refused():
    fig = plans_figure([])
    assert not fig.data and fig.layout.annotations[0].text == "no plans yet: Search"
    with pytest.raises(TypeError, match="step_prediction"):
        plans_figure([StepRecord(rank=0, step=0, loss=1.0, tokens=1, time_s=1.0)])


def steps(times: dict[int, list[float]], plan: str = "dp4") -> list[StepRecord]:
    return [StepRecord(rank=r, step=s, loss=1.0, tokens=64, time_s=t, plan=plan)
            for s, per_rank in times.items() for r, t in enumerate(per_rank)]


def test_step_times_are_the_slowest_rank_per_step_of_the_plan_asked():
    history = steps({0: [0.5, 0.7], 1: [0.3, 0.2]}) + steps({2: [9.0, 9.0]}, plan="tp2")
    assert step_times(history) == [(0, 0.7), (1, 0.3), (2, 9.0)]
    assert step_times(history, plan="dp4") == [(0, 0.7), (1, 0.3)]
    assert step_times(None) == []


def test_measured_points_and_the_prediction_as_a_line_with_its_split():
    p = pred("dp4", 0.010, 0.002, profile="cpu")
    measured = [(0, 0.030), (1, 0.013), (2, 0.012), (3, 0.014)]
    fig = predicted_vs_measured_figure(measured, p)
    assert [t.mode for t in fig.data] == ["markers", "lines"]
    points, line = fig.data
    assert list(points.x) == [0, 1, 2, 3] and list(points.y) == pytest.approx([30, 13, 12, 14])  # ms
    assert list(line.x) == [0, 3] and list(line.y) == pytest.approx([12, 12])
    assert "compute 10" in line.name and "communication 2" in line.name and "bubble 0" in line.name
    assert "measured (slowest rank)" == points.name and fig.layout.yaxis.title.text == "seconds per step (ms)"
    text = fig.layout.title.text.replace("<br>", " ")
    assert "measured against predicted" in text and "dp4 on cpu" in text and "median 1.1x predicted" in text
    assert all(len(line) <= TITLE_CHARS for line in title_of(fig))


def test_a_prediction_before_any_step_and_steps_without_a_prediction():
    p = pred("dp4", 2.0, 1.0)
    alone = predicted_vs_measured_figure([], p)
    assert len(alone.data) == 1 and list(alone.data[0].y) == [3.0, 3.0] and "median" not in alone.layout.title.text
    bare = predicted_vs_measured_figure([(0, 2.0)], None)
    assert len(bare.data) == 1 and bare.data[0].mode == "markers" and "no prediction" in bare.layout.title.text
    empty = predicted_vs_measured_figure(None, None)
    assert not empty.data and empty.layout.annotations[0].text == "no steps yet: Train a step"
