"""A Gantt chart per rank of timed communication ops and pipeline F/B/W events.

Owns the timeline drawing: horizontal bars (`go.Bar`, orientation 'h', base = start, x = duration),
time relative to the earliest start shown. Knows nothing of how the timestamps were taken: ranks on
different hosts are drawn on one axis as given (a Session's timeline() hands them already moved onto
the client's clock, each host's offset corrected). No torch, ipyparallel or widgets. Records never
timed (start == end == 0) are left out.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

import plotly.graph_objects as go

from ..records import CommRecord, PipelineEvent
from ._common import ACTION_COLORS, ACTION_NAMES, MS, OP_COLORS, empty_figure, human_bytes, records_of, styled

TITLE, XT, YT = "Timeline per rank", "ms since the first event", "rank"


def step_filter(steps: int | Iterable[int] | None) -> Callable[[int], bool]:
    """None: every step; an int or an iterable of ints: those steps only."""
    if steps is None:
        return lambda step: True
    wanted = {steps} if isinstance(steps, int) else set(steps)
    return lambda step: step in wanted


def is_timed(rec: CommRecord | PipelineEvent) -> bool:
    return not (rec.start == 0 and rec.end == 0)


def ordered(keys: Iterable[str], order: Iterable[str]) -> list[str]:
    """`keys` in the order of `order`, unknown ones after it alphabetically."""
    pos = {k: i for i, k in enumerate(order)}
    return sorted(set(keys), key=lambda k: (pos.get(k, len(pos)), k))


def timeline_figure(comms: Iterable[CommRecord] | None,
                    pipeline_events: Iterable[PipelineEvent] | None = None,
                    steps: int | Iterable[int] | None = None) -> go.Figure:
    """Gantt per rank: one bar trace per comm op (offsetgroup "comm") and per pipeline action
    (offsetgroup "pipeline", bars labelled with the microbatch), side by side in each rank's row.

    `steps` selects step numbers to show (an int or an iterable of ints; None: all steps).
    """
    keep = step_filter(steps)
    cs = [c for c in records_of(comms, CommRecord) if keep(c.step) and is_timed(c)]
    ev = [e for e in records_of(pipeline_events, PipelineEvent) if keep(e.step) and is_timed(e)]
    if not cs and not ev:
        return empty_figure(TITLE, XT, YT)
    t0 = min(r.start for r in [*cs, *ev])
    ranks = sorted({r.rank for r in [*cs, *ev]})
    fig = go.Figure()
    for op in ordered((c.op for c in cs), OP_COLORS):
        sel = [c for c in cs if c.op == op]
        fig.add_trace(go.Bar(
            orientation="h", y=[f"rank {c.rank}" for c in sel], x=[max(0.0, c.end - c.start) * MS for c in sel],
            base=[(c.start - t0) * MS for c in sel], name=op, marker_color=OP_COLORS.get(op),
            offsetgroup="comm", legendgroup="comm", legendgrouptitle_text="communication",
            customdata=[[human_bytes(c.bytes), c.axis or "world", c.step, (c.end - c.start) * MS,
                         ",".join(map(str, c.group)) if c.group else ("" if c.peer is None else str(c.peer)),
                         (c.start - t0) * MS] for c in sel],
            hovertemplate=(f"%{{y}} {op} on %{{customdata[1]}} (%{{customdata[4]}})<br>%{{customdata[0]}}, "
                           "%{customdata[3]:.2f} ms<br>step %{customdata[2]}, start %{customdata[5]:.1f} ms<extra></extra>")))
    for action in ordered((e.action for e in ev), ACTION_COLORS):
        sel = [e for e in ev if e.action == action]
        fig.add_trace(go.Bar(
            orientation="h", y=[f"rank {e.rank}" for e in sel], x=[max(0.0, e.end - e.start) * MS for e in sel],
            base=[(e.start - t0) * MS for e in sel], name=ACTION_NAMES.get(action, action),
            marker_color=ACTION_COLORS.get(action), offsetgroup="pipeline", legendgroup="pipeline",
            legendgrouptitle_text="pipeline", text=[str(e.microbatch) for e in sel],
            textposition="inside", insidetextanchor="middle",
            customdata=[[e.stage, e.microbatch, e.step, (e.end - e.start) * MS] for e in sel],
            hovertemplate=(f"%{{y}} stage %{{customdata[0]}} {action} microbatch %{{customdata[1]}}<br>"
                           "%{customdata[3]:.2f} ms, step %{customdata[2]}<extra></extra>")))
    styled(fig, TITLE, XT, YT, barmode="group" if cs and ev else "overlay", bargap=0.2)
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=[f"rank {r}" for r in ranks],
                     autorange="reversed")
    return fig
