"""Where each part of a parameter lives, from ShardRecords: a map of the full tensor, and a table.

Owns the plain-data view first (`layout_table`, `shard_regions`) and the drawing second
(`sharding_figure`), in the spirit of torch.distributed.tensor.debug.visualize_sharding. Knows
nothing of DTensor or of how placements were chosen; reads only the index ranges ranks reported.
No torch, ipyparallel or widgets.

The tensor is drawn as 2-D: rows = dim 0, columns = dim 1 (a 1-D tensor is one row; a tensor of
more dims has its trailing dims flattened row-major, so a shard on a trailing dim may appear as
several column stripes). Ranks holding the same index range (replication) share one region, labelled
with every holding rank and its mesh coordinates.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go

from ..records import ShardRecord
from ._common import TOP_AXIS_PX, empty_figure, rank_color, records_of, styled, title_lines

MAX_STRIPES = 256  # beyond this a region's column stripes are drawn as their bounding range
Region = tuple[tuple[int, int], tuple[tuple[int, int], ...]]  # (rows, column intervals)


def _coords(rec: ShardRecord) -> str:
    return ", ".join(f"{k}={v}" for k, v in rec.coords.items())


def _placements(rec: ShardRecord) -> str:
    if len(rec.mesh_axes) == len(rec.placements):
        return ", ".join(f"{a}: {p}" for a, p in zip(rec.mesh_axes, rec.placements))
    return ", ".join(rec.placements)


def _index(rec: ShardRecord) -> list[tuple[int, int]]:
    """Per dim [start, stop); a missing index means the whole tensor (a plain, unsharded tensor)."""
    if len(rec.index) == len(rec.global_shape):
        return [(int(a), int(b)) for a, b in rec.index]
    return [(0, int(n)) for n in rec.global_shape]


def layout_table(shards: Iterable[ShardRecord] | None) -> list[dict[str, Any]]:
    """One plain row per (param, rank), sorted: param, rank, stage, coords, placements,
    global_shape, local_shape and index (as 'a:b' per dim, e.g. '[0:4, 0:8]')."""
    rows = []
    for r in sorted(records_of(shards, ShardRecord), key=lambda r: (r.param, r.rank)):
        rows.append({
            "param": r.param, "rank": r.rank, "stage": r.stage, "coords": _coords(r),
            "placements": _placements(r), "global_shape": list(r.global_shape),
            "local_shape": list(r.local_shape),
            "index": "[" + ", ".join(f"{a}:{b}" for a, b in _index(r)) + "]",
        })
    return rows


def _merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _flatten(shape: Sequence[int], index: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Column intervals that index ranges over `shape` occupy once flattened row-major."""
    ivs, inner = [index[-1]], shape[-1]
    for size, (a, b) in zip(reversed(shape[:-1]), reversed(index[:-1])):
        if ivs == [(0, inner)]:
            ivs = [(a * inner, b * inner)]
        else:
            ivs = _merge((i * inner + x, i * inner + y) for i in range(a, b) for x, y in ivs)
            if len(ivs) > MAX_STRIPES:
                ivs = [(ivs[0][0], ivs[-1][1])]
        inner *= size
    return _merge(ivs)


def region_of(rec: ShardRecord) -> Region:
    shape, index = list(rec.global_shape), _index(rec)
    if not shape:
        return (0, 1), ((0, 1),)
    if len(shape) == 1:
        return (0, 1), (index[0],)
    return index[0], tuple(_flatten(shape[1:], index[1:]))


def shard_regions(shards: Iterable[ShardRecord] | None, param: str) -> list[tuple[Region, list[ShardRecord]]]:
    """[(region, holders)] for `param`: each distinct region with the ranks holding it, by first rank."""
    groups: dict[Region, list[ShardRecord]] = {}
    for r in sorted((r for r in records_of(shards, ShardRecord) if r.param == param), key=lambda r: r.rank):
        groups.setdefault(region_of(r), []).append(r)
    return sorted(groups.items(), key=lambda kv: kv[1][0].rank)


def _shape2d(shape: Sequence[int]) -> tuple[int, int]:
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return 1, int(shape[0])
    return int(shape[0]), math.prod(int(n) for n in shape[1:])


def sharding_figure(shards: Iterable[ShardRecord] | None, param: str | None = None) -> go.Figure:
    """A map of the full tensor of `param` (None: the first param by name): one filled trace per
    distinct region (named `rank 0, 2` by its holders), an annotation per region with every
    holding rank and its mesh coordinates."""
    recs = records_of(shards, ShardRecord)
    if not recs:
        return empty_figure("Sharding", "dim 1", "dim 0")
    names = sorted({r.param for r in recs})
    param = names[0] if param is None else param
    regions = shard_regions(recs, param)
    if not regions:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        return empty_figure(f"Sharding of {param}", "dim 1", "dim 0",
                            text=f"no shard recorded for {param!r} (known: {shown})")
    first = regions[0][1][0]
    shape = list(first.global_shape)
    nrows, ncols = _shape2d(shape)
    fig = go.Figure()
    for (rows, cols), holders in regions:
        _draw_region(fig, rows, cols, holders)
    stage = f", stage {first.stage}" if first.stage is not None else ""
    title = title_lines(f"Sharding of {param}", f"{tuple(shape)}{stage}:", _placements(first) or "plain tensor")
    xt = {0: "", 1: "dim 0"}.get(len(shape), "dim 1" if len(shape) == 2 else f"dims 1..{len(shape) - 1} flattened")
    yt = "dim 0" if len(shape) >= 2 else ""
    styled(fig, title, xt, yt, above=TOP_AXIS_PX, showlegend=True, hovermode="closest", plot_bgcolor="white")
    fig.update_xaxes(range=[0, ncols], showgrid=False, zeroline=False, side="top")
    fig.update_yaxes(range=[nrows, 0], showgrid=False, zeroline=False, showticklabels=len(shape) >= 2)
    return fig


def _draw_region(fig: go.Figure, rows: tuple[int, int], cols: tuple[tuple[int, int], ...],
                 holders: list[ShardRecord]) -> None:
    (r0, r1), ranks = rows, [h.rank for h in holders]
    xs: list[float | None] = []
    ys: list[float | None] = []
    for c0, c1 in cols:
        xs += [c0, c1, c1, c0, c0, None]
        ys += [r0, r0, r1, r1, r0, None]
    label = "<br>".join(f"rank {h.rank}" + (f" ({_coords(h)})" if h.coords else "") for h in holders)
    rng = f"rows {r0}:{r1}, cols " + ", ".join(f"{a}:{b}" for a, b in cols[:4]) + (" ..." if len(cols) > 4 else "")
    color = rank_color(ranks[0])
    fig.add_trace(go.Scatter(
        x=xs, y=ys, mode="lines", fill="toself", fillcolor=color, opacity=0.55,
        line=dict(color="black", width=1), name="rank " + ", ".join(map(str, ranks)),
        hoveron="fills", text=f"{label}<br>{rng}", hoverinfo="text"))
    c0, c1 = cols[0]
    fig.add_annotation(x=(c0 + c1) / 2, y=(r0 + r1) / 2, text=label, showarrow=False,
                       font=dict(size=11, color="black"), bgcolor="rgba(255,255,255,0.6)")
