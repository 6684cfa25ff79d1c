"""Training curves from StepRecords: loss per step and throughput per rank.

Owns how steps are drawn: one trace per rank (named `rank N`), the mean loss over ranks, step time
and tokens/s. Knows nothing of how a step was run, which parallelism produced it, or of torch,
ipyparallel and widgets. NaN losses (pipeline ranks that never see the loss) are skipped.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..records import StepRecord
from ._common import (SUBPLOT_PX, TEMPLATE, empty_figure, is_missing, rank_color, records_of, single_plan, styled,
                      title_layout, top_margin)


def _with_plan(title: str, steps: list[StepRecord]) -> str:
    plan = single_plan(s.plan for s in steps)
    return f"{title} ({plan})" if plan else title


def _latest_by_rank_step(steps: list[StepRecord]) -> dict[int, dict[int, StepRecord]]:
    """rank -> step -> record; a repeated (rank, step) keeps the last record given."""
    out: dict[int, dict[int, StepRecord]] = defaultdict(dict)
    for s in steps:
        out[s.rank][s.step] = s
    return out


def loss_figure(steps: Iterable[StepRecord] | None) -> go.Figure:
    """Loss per step: a thin line per rank (`rank N`) and a thick `mean` line over ranks; under
    gradient clipping also the gradient's norm per step on a right-hand axis.

    NaN or None losses are skipped; a rank that only ever reported NaN gets no trace. The mean of a
    step is over the ranks that reported a finite loss for it.
    """
    recs = records_of(steps, StepRecord)
    title, xt, yt = _with_plan("Training loss", recs), "step", "loss"
    by_rank: dict[int, list[tuple[int, float]]] = {}
    for rank, per_step in sorted(_latest_by_rank_step(recs).items()):
        pts = [(step, float(r.loss)) for step, r in sorted(per_step.items()) if not is_missing(r.loss)]
        if pts:
            by_rank[rank] = pts
    if not by_rank:
        return empty_figure(title, xt, yt)
    fig = go.Figure()
    per_step: dict[int, list[float]] = defaultdict(list)
    for rank, pts in by_rank.items():
        for step, loss in pts:
            per_step[step].append(loss)
        fig.add_trace(go.Scatter(
            x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=f"rank {rank}",
            line=dict(color=rank_color(rank), width=1.5), marker=dict(size=5),
            hovertemplate=f"rank {rank}<br>step %{{x}}<br>loss %{{y:.4f}}<extra></extra>"))
    xs = sorted(per_step)
    fig.add_trace(go.Scatter(
        x=xs, y=[sum(per_step[s]) / len(per_step[s]) for s in xs], mode="lines", name="mean",
        line=dict(color="black", width=4), opacity=0.7,
        hovertemplate="mean<br>step %{x}<br>loss %{y:.4f}<extra></extra>"))
    if len(xs) <= 12:
        fig.update_xaxes(dtick=1)  # steps are whole numbers: no 0.5 ticks on short runs
    _add_grad_norm(fig, recs)
    return styled(fig, title, xt, yt, hovermode="closest", legend_title_text="")


def _add_grad_norm(fig: go.Figure, recs: list[StepRecord]) -> None:
    """Under gradient clipping (Plan.max_grad_norm), the gradient's norm before clipping per step
    (one number per step: every rank takes the whole model's), dashed, on a right-hand axis."""
    norms = {r.step: float(r.grad_norm) for r in recs if r.grad_norm is not None and not is_missing(r.grad_norm)}
    if not norms:
        return
    xs = sorted(norms)
    fig.add_trace(go.Scatter(
        x=xs, y=[norms[s] for s in xs], mode="lines", name="gradient norm (before clipping)", yaxis="y2",
        line=dict(color="grey", width=2, dash="dash"),
        hovertemplate="gradient norm<br>step %{x}<br>%{y:.4f}<extra></extra>"))
    fig.update_layout(yaxis2=dict(title="gradient norm", overlaying="y", side="right", showgrid=False))


def throughput_figure(steps: Iterable[StepRecord] | None) -> go.Figure:
    """Two stacked subplots sharing the step axis: step time (s) on top, tokens/s below, per rank.

    tokens/s of a rank is its own `tokens / time_s` (its share of the batch), not the global rate.
    """
    recs = records_of(steps, StepRecord)
    title = _with_plan("Throughput per rank", recs)
    if not recs:
        return empty_figure(title, "step", "step time (s)")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("step time", "tokens per second"))
    for rank, per_step in sorted(_latest_by_rank_step(recs).items()):
        pts = sorted(per_step.items())
        xs = [step for step, _ in pts]
        common = dict(mode="lines+markers", legendgroup=f"rank {rank}", name=f"rank {rank}",
                      line=dict(color=rank_color(rank), width=1.5), marker=dict(size=5))
        fig.add_trace(go.Scatter(x=xs, y=[r.time_s for _, r in pts], showlegend=True,
                                 hovertemplate=f"rank {rank}<br>step %{{x}}<br>%{{y:.3f}} s<extra></extra>",
                                 **common), row=1, col=1)
        fig.add_trace(go.Scatter(x=xs, y=[r.tokens_per_s for _, r in pts], showlegend=False,
                                 hovertemplate=f"rank {rank}<br>step %{{x}}<br>%{{y:,.0f}} tokens/s<extra></extra>",
                                 **common), row=2, col=1)
    fig.update_layout(template=TEMPLATE, title=title_layout(title, SUBPLOT_PX),
                      margin=dict(t=top_margin(title, SUBPLOT_PX)),
                      hovermode="closest")
    fig.update_yaxes(title_text="step time (s)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    return fig
