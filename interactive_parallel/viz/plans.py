"""Which plan? Predicted step times of ranked plans, and a prediction against the measured steps.

Owns two pictures of StepPredictions: the ranked plans as horizontal stacked bars (compute,
communication not hidden behind compute, pipeline bubble; anything of the predicted seconds the
three leave out as 'other'), best on top, plans that do not fit their memory greyed and marked;
and one plan's measured step time per step (the slowest rank's) as points, with its prediction as
a horizontal line whose legend and hover carry the split. Also the colours of the split (the
panel's table draws the same shares in them) and the reduction of StepRecords to one time per
step. Knows nothing of how a prediction is made (plan/steptime.py) or searched (plan/search.py),
nor of torch, ipyparallel or widgets.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import plotly.graph_objects as go

from ..records import StepPrediction, StepRecord
from ..records.training import latest_run
from ._common import empty_figure, human_bytes, records_of, styled, title_lines

SPLIT: tuple[str, ...] = ("compute", "communication", "bubble")
SPLIT_COLORS = {"compute": "#4c78a8", "communication": "#f58518", "bubble": "#bab0ac", "other": "#72b7b2"}
UNFIT_COLOR = "#d9d9d9"
"""Every part of a plan that does not fit its memory: greyed, so the eye goes to those that do."""
UNFIT_MARK = " ✗ memory"
OTHER_MIN = 1e-9
"""Seconds of a prediction outside its split below which no 'other' part is drawn (rounding)."""
PLANS_TITLE = "Which plan? Predicted step"
STEP_TITLE = "Step time: measured against predicted"
NO_PLANS = "no plans yet: Search"
NO_STEPS = "no steps yet: Train a step"


def parts(pred: StepPrediction) -> dict[str, float]:
    """The prediction's seconds by part: compute, communication, bubble and (when the three
    leave some out) other; they sum to `pred.seconds`."""
    out = {"compute": pred.compute_s, "communication": pred.comm_s, "bubble": pred.bubble_s}
    rest = pred.seconds - sum(out.values())
    if rest > OTHER_MIN:
        out["other"] = rest
    return out


def shares(pred: StepPrediction) -> dict[str, float]:
    """Each part's share of the predicted seconds (0 for a prediction of no time)."""
    total = sum(parts(pred).values())
    return {k: (v / total if total > 0 else 0.0) for k, v in parts(pred).items()}


def ranked(preds: Iterable[StepPrediction]) -> list[StepPrediction]:
    """Best first: plans that fit before those that do not, each by tokens/s, fastest first."""
    return sorted(preds, key=lambda p: (not p.fits, -p.tokens_per_s))


def time_unit(seconds: Iterable[float]) -> tuple[str, float]:
    """('ms', 1000) when every value is under a second, else ('s', 1): a CPU step of a tiny
    model and a 405B model's step both read with a few digits."""
    values = [s for s in seconds if s == s]  # NaN-free
    return ("ms", 1e3) if values and max(values) < 1.0 else ("s", 1.0)


def row_labels(preds: Sequence[StepPrediction]) -> list[str]:
    """'1. dp2xtp2', ... in order: numbered, as two plans may describe alike (knobs describe() leaves
    out), and a category axis would merge their bars; a plan that does not fit is marked."""
    return [f"{i}. {p.plan}{'' if p.fits else UNFIT_MARK}" for i, p in enumerate(preds, 1)]


def _hover(p: StepPrediction, unit: str, scale: float) -> str:
    axes = ", ".join(f"{a} {s * scale:.3g} {unit}" for a, s in sorted(p.comm_by_axis.items()) if s > 0)
    measured = "" if p.measured_s is None else f"<br>measured {p.measured_s * scale:.3g} {unit}"
    return (f"{p.seconds * scale:.3g} {unit} per step on rank {p.rank}{measured}<br>{p.tokens_per_s:,.0f} tokens/s, "
            f"MFU {p.mfu:.1%}<br>memory {human_bytes(p.memory_bytes)}"
            + ("" if p.fits else " (does not fit)") + (f"<br>communication by axis: {axes}" if axes else ""))


def plans_figure(preds: Iterable[StepPrediction] | None, top: int = 15) -> go.Figure:
    """One horizontal bar per plan (the `top` best, ranked as `ranked` ranks them, best on top),
    stacked compute / communication / bubble (/ other) seconds; the row label is the plan's
    describe(), hover adds tokens/s, MFU, memory and communication by mesh axis; a plan that
    does not fit is greyed and its label marked."""
    every = records_of(preds, StepPrediction)
    profiles = sorted({p.profile for p in every})
    on = f"on {', '.join(profiles)}" if profiles else ""
    if not every:
        return empty_figure(title_lines(PLANS_TITLE, "per plan"), "seconds per step", "", text=NO_PLANS)
    shown = ranked(every)[:max(top, 1)]
    unit, scale = time_unit(p.seconds for p in shown)
    labels = row_labels(shown)
    unfit = sum(not p.fits for p in every)
    title = title_lines(PLANS_TITLE, on + ",", f"best {len(shown)} of {len(every)} by tokens/s",
                        f"({unfit} {'does' if unfit == 1 else 'do'} not fit, greyed)" if unfit else "")
    hovers = [_hover(p, unit, scale) for p in shown]
    names = [*SPLIT, *(["other"] if any("other" in parts(p) for p in shown) else [])]
    fig = go.Figure()
    for name in names:
        values = [parts(p).get(name, 0.0) * scale for p in shown]
        fig.add_trace(go.Bar(
            orientation="h", y=labels, x=values, name=name,
            marker=dict(color=[SPLIT_COLORS[name] if p.fits else UNFIT_COLOR for p in shown],
                        line=dict(color="white", width=0.5)),
            customdata=[[h, f"{share.get(name, 0.0):.0%}"] for h, share in zip(hovers, (shares(p) for p in shown))],
            hovertemplate=(f"%{{y}}<br>{name} %{{x:.3g}} {unit} (%{{customdata[1]}})<br>%{{customdata[0]}}"
                           "<extra></extra>")))
    styled(fig, title, f"predicted seconds per step ({unit})", "", barmode="stack", bargap=0.25,
           legend=dict(orientation="h", yanchor="top", y=-0.15, x=0))
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=labels, autorange="reversed",
                     automargin=True)
    return fig


def step_times(steps: Iterable[StepRecord] | None, plan: str | None = None) -> list[tuple[int, float]]:
    """(step, seconds) per step, the slowest rank's, in step order; with `plan` (a describe()), only
    the latest unbroken run under it (records.training.latest_run: a session's history spans
    every plan it applied, and every model it loaded)."""
    if plan is not None:
        return latest_run(records_of(steps, StepRecord), plan)
    slowest: dict[int, float] = {}
    for r in records_of(steps, StepRecord):
        slowest[r.step] = max(slowest.get(r.step, 0.0), r.time_s)
    return sorted(slowest.items())


def _split_text(p: StepPrediction, unit: str, scale: float) -> str:
    return ", ".join(f"{k} {v * scale:.3g}" for k, v in parts(p).items()) + f" {unit}"


def predicted_vs_measured_figure(history_step_times: Iterable[tuple[int, float]] | None,
                                 predicted: StepPrediction | None) -> go.Figure:
    """The measured step time per step (the slowest rank's: `step_times`) as points, and the
    prediction as a horizontal line across them, its split (compute, communication, bubble) in
    its legend entry and hover; the title says the plan, the profile and the measured median
    over the predicted."""
    points = sorted(history_step_times or [])
    head = [STEP_TITLE]
    if predicted is not None:
        head.append(f"({predicted.plan} on {predicted.profile})")
    if not points and predicted is None:
        return empty_figure(title_lines(*head), "step", "seconds per step", text=NO_STEPS)
    unit, scale = time_unit([s for _, s in points] + ([predicted.seconds] if predicted is not None else []))
    fig = go.Figure()
    if points:
        fig.add_trace(go.Scatter(
            x=[s for s, _ in points], y=[t * scale for _, t in points], mode="markers", name="measured (slowest rank)",
            marker=dict(size=7, color=SPLIT_COLORS["compute"]),
            hovertemplate=f"step %{{x}}<br>measured %{{y:.3g}} {unit} (slowest rank)<extra></extra>"))
    if predicted is not None:
        xs = [points[0][0], points[-1][0]] if points else [0, 1]
        split = _split_text(predicted, unit, scale)
        fig.add_trace(go.Scatter(
            x=xs, y=[predicted.seconds * scale] * 2, mode="lines", name=f"predicted: {split}",
            line=dict(color=SPLIT_COLORS["communication"], width=2, dash="dash"),
            hovertemplate=(f"predicted {predicted.seconds * scale:.3g} {unit}<br>{split}<br>"
                           f"{predicted.tokens_per_s:,.0f} tokens/s, MFU {predicted.mfu:.1%}<extra></extra>")))
        if points and predicted.seconds > 0:
            ratio = statistics.median(t for _, t in points) / predicted.seconds
            head.append(f"measured median {ratio:.2g}x predicted")
    elif points:
        head.append("(no prediction)")
    styled(fig, title_lines(*head), "step", f"seconds per step ({unit})", hovermode="closest",
           legend=dict(orientation="h", yanchor="top", y=-0.2, x=0))
    fig.update_yaxes(rangemode="tozero")
    if len(points) <= 12:
        fig.update_xaxes(dtick=1)
    return fig
