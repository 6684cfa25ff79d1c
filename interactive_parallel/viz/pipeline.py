"""The pipeline schedule of one step from PipelineEvents, and its bubble fraction.

Owns the schedule picture (a row per stage, bars per F/B/W labelled with the microbatch) and the
bubble arithmetic. Knows nothing of which schedule (GPipe, 1F1B, zero bubble) produced the events,
nor of torch, ipyparallel or widgets.

Bubble fraction: within one step, total = latest end - earliest start over all stages; a row's busy
time is the union of its event intervals (overlaps count once); a row's bubble = 1 - busy / total.
A row is one (stage, rank): with data parallelism beside pipelining several ranks run a stage, and a
stage's bubble is the mean of its rows. The overall bubble is the mean over stages.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import plotly.graph_objects as go

from ..records import PipelineEvent
from ._common import ACTION_COLORS, ACTION_NAMES, MS, empty_figure, records_of, styled, title_lines
from .timeline import is_timed, ordered

XT, YT = "ms since the step's first event", "stage"


def _busy(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _select_step(events: list[PipelineEvent], step: int | None) -> tuple[int | None, list[PipelineEvent]]:
    timed = [e for e in events if is_timed(e)]
    if not timed:
        return None, []
    chosen = max(e.step for e in timed) if step is None else step
    return chosen, [e for e in timed if e.step == chosen]


def bubble_fractions(events: Iterable[PipelineEvent] | None,
                     step: int | None = None, by: str = "rank") -> dict[int, float]:
    """rank (or stage) -> idle fraction in [0, 1] of the step's span, for `step` (None: the
    latest step with timed events).

    By rank is the bubble that costs time: under interleaved schedules a rank runs several
    stages, and one stage's row standing idle while the same rank works on another stage is
    not a bubble. By stage, rows of several data-parallel ranks of a stage are averaged.
    """
    _, evs = _select_step(records_of(events, PipelineEvent), step)
    return _fractions(evs, by)


def _fractions(evs: list[PipelineEvent], by: str = "rank") -> dict[int, float]:
    if by not in ("rank", "stage"):
        raise ValueError(f"by={by!r}: expected 'rank' or 'stage'")
    if not evs:
        return {}
    total = max(e.end for e in evs) - min(e.start for e in evs)
    rows: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in evs:
        rows[(e.rank, -1) if by == "rank" else (e.stage, e.rank)].append((e.start, e.end))
    grouped: dict[int, list[float]] = defaultdict(list)
    for (key, _), iv in rows.items():
        grouped[key].append(1.0 - _busy(iv) / total if total > 0 else 0.0)
    return {k: sum(v) / len(v) for k, v in sorted(grouped.items())}


def overall_bubble(fractions: dict[int, float]) -> float:
    return sum(fractions.values()) / len(fractions) if fractions else 0.0


def pipeline_figure(events: Iterable[PipelineEvent] | None,
                    step: int | None = None) -> go.Figure:
    """The schedule of one step (None: the latest): y = stage (one row per rank of the stage when
    several ranks run it), x = milliseconds from the step's first event, one bar trace per action ("F:
    forward", "B: backward", "W: weight grad"), each bar labelled with its microbatch. The title
    gives the overall bubble fraction and each rank's idle fraction."""
    chosen, evs = _select_step(records_of(events, PipelineEvent), step)
    if not evs:
        return empty_figure("Pipeline schedule", XT, YT)
    fractions = _fractions(evs)
    t0 = min(e.start for e in evs)
    ranks_of: dict[int, set[int]] = defaultdict(set)
    for e in evs:
        ranks_of[e.stage].add(e.rank)

    def row(e: PipelineEvent) -> str:
        return f"stage {e.stage}" if len(ranks_of[e.stage]) == 1 else f"stage {e.stage} · rank {e.rank}"

    rows = [f"stage {s}" if len(rs) == 1 else f"stage {s} · rank {r}"
            for s, rs in sorted(ranks_of.items()) for r in sorted(rs)]
    fig = go.Figure()
    for action in ordered((e.action for e in evs), ACTION_COLORS):
        sel = sorted((e for e in evs if e.action == action), key=lambda e: (e.stage, e.start))
        fig.add_trace(go.Bar(
            orientation="h", y=[row(e) for e in sel], x=[max(0.0, e.end - e.start) * MS for e in sel],
            base=[(e.start - t0) * MS for e in sel], name=ACTION_NAMES.get(action, action),
            marker=dict(color=ACTION_COLORS.get(action), line=dict(color="white", width=1)),
            text=[str(e.microbatch) for e in sel], textposition="inside", insidetextanchor="middle",
            customdata=[[e.rank, e.microbatch, (e.end - e.start) * MS, (e.start - t0) * MS] for e in sel],
            hovertemplate=(f"%{{y}} (rank %{{customdata[0]}}) {action} microbatch %{{customdata[1]}}<br>"
                           "start %{customdata[3]:.1f} ms, %{customdata[2]:.2f} ms long<extra></extra>")))
    title = title_lines(f"Pipeline schedule, step {chosen}:", f"bubble {overall_bubble(fractions):.1%}",
                        _idle(fractions))
    styled(fig, title, XT, YT, barmode="overlay", bargap=0.15)
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=rows, autorange="reversed")
    return fig


IDLE_EACH = 4
"""Up to this many ranks the title names each rank's idle share; beyond, their range (a line)."""


def _idle(fractions: dict[int, float]) -> str:
    if len(fractions) <= IDLE_EACH:
        return "(idle per rank: " + ", ".join(f"rank {r} {f:.0%}" for r, f in fractions.items()) + ")"
    return f"(idle per rank {min(fractions.values()):.0%} to {max(fractions.values()):.0%})"
