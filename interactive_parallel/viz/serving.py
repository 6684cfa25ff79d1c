"""Served requests from RequestRecords: a timeline with a row per request, and their latencies.

Owns the request timeline (each request a row: waiting from arrival to admission, prefill
from admission to its first token, decode until it finished, a marker where it ended) and
the per-request time to first token and time per output token. Knows nothing of how
requests were scheduled (runtime/inference/serve.py) or of torch, ipyparallel and widgets.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..records import RequestRecord
from ._common import SUBPLOT_PX, empty_figure, records_of, styled

PHASE_COLORS = {"waiting": "#bab0ac", "prefill": "#f58518", "decode": "#4c78a8"}
EMPTY = "no requests yet: serve some"


def request_phases(requests: Iterable[RequestRecord]) -> list[dict]:
    """Per request, in the order given: {'id', 'waiting': (start, end), 'prefill': ..., 'decode': ...,
    'end', 'reason'}; a phase that never began is None (an interrupted request)."""
    out = []
    for r in requests:
        end = r.finished if r.finished >= 0 else None
        admitted = r.admitted if r.admitted >= 0 else None
        first = r.first_token if r.first_token >= 0 else None
        out.append({
            "id": r.id, "reason": r.finish_reason, "end": end,
            "waiting": (r.arrival, admitted if admitted is not None else (end or r.arrival)),
            "prefill": (admitted, first) if admitted is not None and first is not None else None,
            "decode": (first, end) if first is not None and end is not None else None,
        })
    return out


def request_timeline_figure(requests: Iterable[RequestRecord] | None, title: str = "Requests") -> go.Figure:
    """Horizontal bars, a row per request (first arrival at the top): grey while waiting, orange
    for its prefill (admission to first token), blue while decoding; a dot where it finished
    (hover: why). Seconds after the serving call started."""
    reqs = sorted(records_of(requests, RequestRecord), key=lambda r: (r.arrival, r.id))
    if not reqs:
        return empty_figure(title, "seconds", "request", text=EMPTY)
    phases = request_phases(reqs)
    fig = go.Figure()
    for phase, color in PHASE_COLORS.items():
        rows = [(p["id"], p[phase]) for p in phases if p[phase] is not None]
        fig.add_trace(go.Bar(
            name=phase, orientation="h", marker_color=color, y=[rid for rid, _ in rows],
            x=[max(b - a, 0.0) for _, (a, b) in rows], base=[a for _, (a, b) in rows],
            hovertemplate=f"%{{y}} {phase}: %{{base:.3f}} to %{{x:.3f}} s later<extra></extra>"))
    ended = [p for p in phases if p["end"] is not None]
    fig.add_trace(go.Scatter(name="done", mode="markers", marker=dict(color="#222", size=6, symbol="line-ns-open"),
                             y=[p["id"] for p in ended], x=[p["end"] for p in ended],
                             text=[p["reason"] for p in ended], hovertemplate="%{y} done (%{text})<extra></extra>"))
    styled(fig, title, "seconds after the call started", "request", barmode="overlay")
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=[r.id for r in reversed(reqs)])
    return fig


def latency_figure(requests: Iterable[RequestRecord] | None, title: str = "Latency per request") -> go.Figure:
    """Time to first token (from arrival) and time per output token (after the first), per
    request, in milliseconds, with their means in the subplot titles."""
    reqs = sorted(records_of(requests, RequestRecord), key=lambda r: (r.arrival, r.id))
    if not reqs:
        return empty_figure(title, "request", "ms", text=EMPTY)
    ttft = [r.ttft * 1e3 for r in reqs]
    tpot = [r.tpot * 1e3 for r in reqs]
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        f"time to first token (mean {_mean(ttft):.1f} ms)", f"time per output token (mean {_mean(tpot):.1f} ms)"))
    ids = [r.id for r in reqs]
    fig.add_trace(go.Bar(name="time to first token", x=ids, y=ttft, marker_color="#f58518"), row=1, col=1)
    fig.add_trace(go.Bar(name="time per output token", x=ids, y=tpot, marker_color="#4c78a8"), row=1, col=2)
    styled(fig, title, "", "ms", above=SUBPLOT_PX, showlegend=False)
    fig.update_xaxes(type="category")
    return fig


def _mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else float("nan")
