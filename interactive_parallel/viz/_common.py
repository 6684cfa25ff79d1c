"""What every figure in viz/ shares: input normalisation, the empty state, units and colours.

Owns how viz/ accepts its input (records, possibly a mixed list that is filtered by kind), the empty-state figure and the palette, so that rank 3 has the same colour in every figure.
Knows nothing of torch, ipyparallel or widgets, nor of what any one figure shows.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

import plotly.graph_objects as go
from plotly.colors import qualitative

from ..records import Record

EMPTY_TEXT = "no data yet: train a step"
MiB = 1024 ** 2
PALETTE: tuple[str, ...] = tuple(qualitative.Plotly)
TEMPLATE = "plotly_white"

OP_COLORS = {
    "all_reduce": "#1f77b4", "all_gather": "#2ca02c", "reduce_scatter": "#ff7f0e",
    "broadcast": "#9467bd", "all_to_all": "#8c564b", "send": "#e377c2", "recv": "#17becf",
    "barrier": "#7f7f7f",
}
ACTION_COLORS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}
ACTION_NAMES = {"F": "F: forward", "B": "B: backward", "W": "W: weight grad"}

R = TypeVar("R", bound=Record)


def records_of(items: Iterable[Any] | None, cls: type[R]) -> list[R]:
    """The records of type `cls` in `items` (None means none).

    Records of other kinds are dropped, so a mixed list works; a non-empty list holding no `cls`
    at all is a mistake and raises TypeError, as does anything that is not a record (a dict is
    read with `records.from_dict` first: viz draws records, not their wire or file form).
    """
    if items is None:
        return []
    out: list[R] = []
    others: set[str] = set()
    for item in items:
        if not isinstance(item, Record):
            raise TypeError(f"expected {cls.__name__} records, got a {type(item).__name__}"
                            + (" (read dicts with interactive_parallel.records.from_dict)" if isinstance(item, dict)
                               else ""))
        if isinstance(item, cls):
            out.append(item)
        else:
            others.add(item.kind)
    if others and not out:
        raise TypeError(f"expected {cls.kind!r} records ({cls.__name__}), got only {sorted(others)}")
    return out


def is_missing(x: Any) -> bool:
    """True for None and NaN (a pipeline rank that never sees the loss reports NaN)."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def rank_color(rank: int) -> str:
    return PALETTE[rank % len(PALETTE)]


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value} B"  # unreachable


def styled(fig: go.Figure, title: str, xaxis: str, yaxis: str, **layout: Any) -> go.Figure:
    """Apply the shared look: template, title, axis titles."""
    fig.update_layout(template=TEMPLATE, title=dict(text=title), xaxis_title=xaxis, yaxis_title=yaxis,
                      **layout)
    return fig


def empty_figure(title: str, xaxis: str = "", yaxis: str = "", text: str = EMPTY_TEXT) -> go.Figure:
    """A figure with no traces and a centred note saying why (by default: no data yet)."""
    fig = styled(go.Figure(), title, xaxis, yaxis)
    fig.add_annotation(text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                       font=dict(size=16, color="#888"))
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False)
    fig.update_yaxes(showticklabels=False, showgrid=False, zeroline=False)
    return fig


def single_plan(plans: Iterable[str]) -> str:
    """The plan label all records share, or '' when they differ or carry none."""
    distinct = {p for p in plans if p}
    return distinct.pop() if len(distinct) == 1 else ""
