"""What every figure in viz/ shares: input normalisation, the empty state, units and colours.

Owns how viz/ accepts its input (records, possibly a mixed list that is filtered by kind), the
empty-state figure, the palette (so that rank 3 has the same colour in every figure) and how a
title is set and broken into lines that fit a figure of TITLE_FITS_PX. Knows nothing of torch,
ipyparallel or widgets, nor of what any one figure shows.
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
MS = 1e3
"""Milliseconds a second: a timeline reads in ms from its step's (or first) event; records hold seconds."""

R = TypeVar("R", bound=Record)

TITLE_SIZE = 14
"""Title font size (px): a step below plotly's default, so a title reads as a heading yet a
half-width figure holds a line of TITLE_CHARS."""
TITLE_CHARS = 44
"""Characters per title line. At TITLE_SIZE in the fonts plotly falls back to (Verdana, DejaVu
Sans: wider than Open Sans) such a line stays inside a figure TITLE_FITS_PX wide."""
TITLE_LINE_PX = round(TITLE_SIZE * 1.3)
"""A title line's height (plotly spaces lines at 1.3 em)."""
TITLE_TOP_PX = 8
"""Above the title's first line."""
TITLE_GAP_PX = 6
"""Between the title's last line and what is under it."""
SUBPLOT_PX = 24
"""Room over the plot area for make_subplots' titles."""
TOP_AXIS_PX = 44
"""Room over the plot area for an x axis drawn on top (its ticks and its title)."""
TITLE_FITS_PX = 320
"""The narrowest figure a title must fit: whoever lays figures out (the panel) keeps them at
least this wide, or as wide as the column when it is narrower."""


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


def title_lines(*parts: str, width: int = TITLE_CHARS) -> str:
    """`parts` joined by spaces into lines of at most `width` characters, joined by '<br>'.

    A part is kept whole on one line when it fits one (so '4 ranks (dp 2 x tp 2)' is never cut
    in two); a longer part is broken between words, and a word longer than a line after its dots
    ('model.layers.0.' / 'mlp.weight').
    """
    lines: list[str] = []
    for part in (p for p in parts if p):
        pieces = [part] if len(part) <= width else [w for word in part.split() for w in _cut(word, width)]
        for piece in pieces:
            if lines and len(lines[-1]) + 1 + len(piece) <= width:
                lines[-1] += " " + piece
            else:
                lines.append(piece)
    return "<br>".join(lines)


def _cut(word: str, width: int) -> list[str]:
    """A word in pieces of at most `width`, cut after dots where it has them, else anywhere."""
    if len(word) <= width:
        return [word]
    out = [""]
    for chunk in word.replace(".", ".\0").split("\0"):
        while len(chunk) > width:
            out += [chunk[:width], ""]
            chunk = chunk[width:]
        if len(out[-1]) + len(chunk) > width:
            out.append("")
        out[-1] += chunk
    return [o for o in out if o]


def title_with(title: str, part: str, width: int = TITLE_CHARS) -> str:
    """`title` with `part` added after its last line, or on a line of its own when it would not fit
    (the panel adds '(dry run)' to a figure it draws from a dry run)."""
    head, _, last = title.rpartition("<br>")
    return (head + "<br>" if head else "") + title_lines(last, part, width=width)


def styled(fig: go.Figure, title: str, xaxis: str, yaxis: str, *, above: int = 0, **layout: Any) -> go.Figure:
    """Apply the shared look: template, title (TITLE_SIZE, at the top, the top margin as tall as
    its lines plus `above`, the px of what a figure draws over its plot area: subplot titles,
    ticks on top), axis titles."""
    fig.update_layout(template=TEMPLATE, title=title_layout(title, above), margin=dict(t=top_margin(title, above)),
                      xaxis_title=xaxis, yaxis_title=yaxis, **layout)
    return fig


def top_margin(title: str, above: int = 0) -> int:
    """The top margin that holds every line of `title` and `above` px under it."""
    return TITLE_TOP_PX + TITLE_LINE_PX * len(fitted(title).split("<br>")) + TITLE_GAP_PX + above


def add_to_title(fig: go.Figure, part: str) -> go.Figure:
    """`fig` with `part` after its title (`title_with`), the top margin grown by any line it added."""
    old = fig.layout.title.text or ""
    new = title_with(old, part)
    grown = TITLE_LINE_PX * (new.count("<br>") - old.count("<br>"))
    return fig.update_layout(title_text=new, margin_t=(fig.layout.margin.t or top_margin(old)) + grown,
                             title_pad_b=(fig.layout.title.pad.b or 0) + grown)


def fitted(title: str) -> str:
    """`title` as it is when every line fits TITLE_CHARS, else each too long line broken between words."""
    lines = title.split("<br>")
    return title if all(len(line) <= TITLE_CHARS for line in lines) else title_lines(*lines)


def title_layout(text: str, above: int = 0) -> dict[str, Any]:
    """A layout's `title`: from the figure's left edge (a line of TITLE_CHARS then fits
    TITLE_FITS_PX), its last line `above` px over the plot area; `top_margin` makes the room.

    Anchored on the plot area's top: plotly keeps a title's first line where a one-line title
    would be and adds lines below it, so the padding grows by a line for each line after the first.
    """
    text = fitted(text)
    lines = len(text.split("<br>"))
    return dict(text=text, font=dict(size=TITLE_SIZE), x=0.01, xref="container", xanchor="left", y=1,
                yref="paper", yanchor="bottom", pad=dict(b=above + TITLE_GAP_PX + TITLE_LINE_PX * (lines - 1)))


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
