"""Memory per rank from MemoryRecords: stacked params / grads / optimizer / activations.

Owns the measured-versus-predicted bar chart: each rank has a "measured" stack and, when a prediction
is given, a "predicted" stack beside it (offset groups). A CUDA rank's allocator peak (`device_peak`:
every kind of bytes at once, beyond what was live at the step's start) is not a component of the
stack; its hover text names it, only where it is nonzero. Knows nothing of how bytes were measured or
estimated (runtime/ probes and plan/ estimates do that), nor of torch, ipyparallel or widgets.
"""
from __future__ import annotations

from collections.abc import Iterable

import plotly.graph_objects as go

from ..records import MemoryRecord
from ._common import MiB, empty_figure, human_bytes, records_of, styled, title_lines

COMPONENTS: tuple[str, ...] = ("params", "grads", "optimizer", "activations")
COMPONENT_COLORS = {"params": "#4c78a8", "grads": "#f58518", "optimizer": "#e45756",
                    "activations": "#72b7b2"}
TITLE, XT, YT = "Memory per rank", "rank", "MiB"


def latest_per_rank(records: Iterable[MemoryRecord]) -> dict[int, MemoryRecord]:
    """rank -> its record of the highest step (the last one given wins a tie)."""
    out: dict[int, MemoryRecord] = {}
    for r in records:
        if r.rank not in out or r.step >= out[r.rank].step:
            out[r.rank] = r
    return out


def memory_figure(memory: Iterable[MemoryRecord] | None,
                  predicted: Iterable[MemoryRecord] | None = None) -> go.Figure:
    """Stacked bars of bytes per rank (axis in MiB), the latest step of each rank.

    One trace per component and group: "params", "grads", ... (offsetgroup "measured") and, with
    `predicted`, "params (predicted)", ... (offsetgroup "predicted", hatched). Each bar's `y` is the
    component in MiB and its `base` the sum of the components below it; `customdata` holds bytes.
    """
    measured = latest_per_rank(records_of(memory, MemoryRecord))
    pred = latest_per_rank(records_of(predicted, MemoryRecord))
    if not measured and not pred:
        return empty_figure(TITLE, XT, YT)
    fig = go.Figure()
    for group, recs in (("measured", measured), ("predicted", pred)):
        if recs:
            _add_stack(fig, group, recs)
    steps = sorted({r.step for r in measured.values()})
    which = f"(step {steps[0]})" if len(steps) == 1 else "(latest step of each rank)" if steps else ""
    title = title_lines(TITLE, which)
    ranks = sorted(set(measured) | set(pred))
    styled(fig, title, XT, YT, barmode="group", bargap=0.25, bargroupgap=0.05)
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=[f"rank {r}" for r in ranks])
    return fig


def _add_stack(fig: go.Figure, group: str, recs: dict[int, MemoryRecord]) -> None:
    ranks = sorted(recs)
    x = [f"rank {r}" for r in ranks]
    base = [0] * len(ranks)
    predicted = group == "predicted"
    peaks = [int(getattr(recs[r], "device_peak", 0) or 0) for r in ranks]
    for comp in COMPONENTS:
        values = [int(getattr(recs[r], comp) or 0) for r in ranks]
        totals = [int(recs[r].params) + int(recs[r].grads) + int(recs[r].optimizer)
                  + int(recs[r].activations or 0) for r in ranks]
        customdata = [[v, human_bytes(v), human_bytes(t)] for v, t in zip(values, totals)]
        hover = (f"%{{x}} {group}<br>{comp}: %{{customdata[1]}} (%{{customdata[0]:,}} B)"
                 "<br>total: %{customdata[2]}")
        if any(peaks):
            for row, p in zip(customdata, peaks):
                row.append(f"<br>device peak (allocator, every kind at once): {human_bytes(p)}" if p else "")
            hover += "%{customdata[3]}"
        fig.add_trace(go.Bar(
            x=x, y=[v / MiB for v in values], base=[b / MiB for b in base],
            name=f"{comp} (predicted)" if predicted else comp,
            offsetgroup=group, legendgroup=group, legendgrouptitle_text=group,
            marker=dict(color=COMPONENT_COLORS[comp],
                        pattern=dict(shape="/" if predicted else "", fillmode="overlay"),
                        line=dict(width=0.5, color="white")),
            opacity=0.6 if predicted else 1.0,
            customdata=customdata,
            hovertemplate=hover + "<extra></extra>"))
        base = [b + v for b, v in zip(base, values)]
