"""A pipeline schedule before it runs (torch's simulation) beside the one that ran (measured).

Owns the preview picture: a row per pipeline rank, x = the simulator's slots, a bar per action
(forward, input / weight halves of a backward, full backward, sends and receives) labelled with
its microbatch and stage; and, when PipelineEvents are given, a second panel with the measured
step drawn as viz/pipeline.py draws it (its picture and bubble arithmetic, not a copy).
Knows nothing of torch, ipyparallel or widgets: it reads a SchedulePreview record.
"""
from __future__ import annotations

from collections.abc import Iterable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..records import PipelineEvent
from ..records.schedule import COMM_ACTIONS, SchedulePreview
from ._common import ACTION_COLORS, ACTION_NAMES, SUBPLOT_PX, empty_figure, records_of, styled, title_lines
from .pipeline import XT as PIPELINE_XT, bubble_fractions, overall_bubble, pipeline_figure

PREVIEW_COLORS = {**ACTION_COLORS, "I": "#e45756", "SEND_F": "#bab0ac", "RECV_F": "#d8d4d0",
                  "SEND_B": "#9d755d", "RECV_B": "#c9a88f"}
PREVIEW_NAMES = {**ACTION_NAMES, "B": "B: full backward", "I": "I: backward, input", "W": "W: backward, weights",
                 "SEND_F": "send activations", "RECV_F": "receive activations", "SEND_B": "send gradients",
                 "RECV_B": "receive gradients"}
ORDER = ("F", "I", "W", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
XS, YS = "simulator slot", "pipeline rank"


def _idle_text(idle: dict[int, float]) -> str:
    return "idle " + ", ".join(f"rank {r} {f:.0%}" for r, f in sorted(idle.items()))


def _preview_traces(preview: SchedulePreview) -> list[go.Bar]:
    traces = []
    for kind in ORDER:
        sel = [a for a in preview.actions if a.action == kind]
        if not sel:
            continue
        comm = kind in COMM_ACTIONS
        traces.append(go.Bar(
            orientation="h", y=[f"rank {a.rank}" for a in sel], x=[1.0] * len(sel), base=[a.slot for a in sel],
            name=PREVIEW_NAMES[kind], marker=dict(color=PREVIEW_COLORS[kind], line=dict(color="white", width=1),
                                                  pattern_shape="x" if any(a.overlapped for a in sel) else ""),
            width=0.45 if comm else 0.8, legendgroup="preview",
            text=["" if comm else f"{a.microbatch}<br>s{a.stage}" for a in sel], textposition="inside",
            insidetextanchor="middle",
            customdata=[[a.stage, a.microbatch, a.slot, " (overlapped)" if a.overlapped else ""] for a in sel],
            hovertemplate=(f"%{{y}}: {kind} stage %{{customdata[0]}} microbatch %{{customdata[1]}}"
                           "%{customdata[3]}<br>slot %{customdata[2]}<extra></extra>")))
    return traces


def schedule_figure(preview: SchedulePreview, measured: Iterable[PipelineEvent] | None = None,
                    step: int | None = None) -> go.Figure:
    """torch's simulated order of the plan's schedule, a row per pipeline rank (bars labelled
    microbatch and stage, sends and receives as thin bars), and beside it, given PipelineEvents,
    the measured step `step` (None: the latest) with its idle share per rank."""
    events = records_of(measured, PipelineEvent)
    head = (f"Schedule {preview.schedule} ({preview.torch_class}),", f"pp {preview.pp}, {preview.microbatches} microbatches:",
            "simulated " + _idle_text(preview.idle))
    title = title_lines(*head)
    if not preview.actions:
        return empty_figure(title, XS, YS, text="no actions: the plan has no pipeline")
    rows = [f"rank {r}" for r in sorted(preview.idle)]
    if not events:
        fig = go.Figure(_preview_traces(preview))
        styled(fig, title, XS, YS, barmode="overlay", bargap=0.15)
        fig.update_yaxes(type="category", categoryorder="array", categoryarray=rows, autorange="reversed")
        return fig
    fractions = bubble_fractions(events, step)
    title = title_lines(*head, "measured " + _idle_text(fractions), f"(bubble {overall_bubble(fractions):.0%})")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("simulated (torch)", "measured"))
    for t in _preview_traces(preview):
        fig.add_trace(t, row=1, col=1)
    for t in pipeline_figure(events, step).data:
        t.legendgroup, t.showlegend = "measured", False  # the preview's legend names F / B / W already
        fig.add_trace(t, row=1, col=2)
    styled(fig, title, XS, YS, above=SUBPLOT_PX, barmode="overlay", bargap=0.15)
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=rows, autorange="reversed", row=1, col=1)
    fig.update_yaxes(type="category", autorange="reversed", row=1, col=2)
    fig.update_xaxes(title_text=PIPELINE_XT, row=1, col=2)
    return fig
