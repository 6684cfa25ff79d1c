"""The device mesh as one figure: every rank a cell, the collectives of a step as links.

Owns folding any number of mesh axes into a grid (`mesh_grid`, plain data: which axes run
along the rows and which along the columns, each cell's rank and coordinates), the links
of a step's collectives (`comm_links`, plain data: per mesh axis, the groups and the bytes
each member issued), and the drawing (`mesh_figure`). A cell's colour is the rank's memory
(measured when given, else predicted; MiB or GiB); hovering it shows its coordinates, what it holds of
a chosen parameter (from ShardRecords) and its predicted and measured memory. Each group
of a collective is drawn as a ring through its members' cells (the order a ring
all-reduce visits them), a point-to-point op as a link to its peer, each axis bowing by
its own amount so that links of different axes between the same cells stay apart; the
line width grows with the bytes per rank and step on that axis.

Works from live records and dry-run records alike (they are the same types); `source`
labels the figure ("dry run"). Knows nothing of how the records were made, nor of torch,
ipyparallel or widgets.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from ..plan.axes import MESH_ORDER, MeshAxis, expert_coords, mesh_coords
from ..records import CommRecord, MemoryRecord, ShardRecord
from ._common import OP_COLORS, TOP_AXIS_PX, empty_figure, human_bytes, records_of, styled, title_lines
from .memory import latest_per_rank

AXIS_COLORS = {"tp": "#d62728", "cp": "#9467bd", "fsdp": "#2ca02c", "dp": "#1f77b4", "pp": "#ff7f0e"}
TEXT_CELLS = 256
"""Grids up to this many cells print each rank's coordinates in its cell (beyond: hover only)."""
ALL_LINKS = 64
"""Meshes up to this many ranks draw every group's links; larger ones the groups of `focus`."""
MAX_TICKS = 32


@dataclass(frozen=True)
class MeshGrid:
    """A mesh folded into rows x columns: each axis runs along the rows or the columns, outer
    axes (in MESH_ORDER) varying slowest, so a run of neighbouring ranks (tp) sits in a row."""

    shape: tuple[tuple[str, int], ...]
    """(axis, size) of every axis of size > 1, in MESH_ORDER."""
    row_axes: tuple[str, ...]
    col_axes: tuple[str, ...]

    @property
    def world(self) -> int:
        return math.prod(n for _, n in self.shape)

    def _size(self, axes: tuple[str, ...]) -> int:
        sizes = dict(self.shape)
        return math.prod(sizes[a] for a in axes)

    @property
    def rows(self) -> int:
        return self._size(self.row_axes)

    @property
    def cols(self) -> int:
        return self._size(self.col_axes)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each axis of the grid (the runtime's layout: plan.mesh_coords)."""
        sizes = dict(self.shape)
        full = mesh_coords(rank, {a: sizes.get(a.value, 1) for a in MESH_ORDER})
        return {a.value: c for a, c in full.items() if a.value in sizes}

    def _index(self, axes: tuple[str, ...], coords: Mapping[str, int]) -> int:
        sizes, out = dict(self.shape), 0
        for a in axes:
            out = out * sizes[a] + coords[a]
        return out

    def cell(self, rank: int) -> tuple[int, int]:
        """(row, column) of `rank`."""
        c = self.coords(rank)
        return self._index(self.row_axes, c), self._index(self.col_axes, c)


def mesh_grid(shape: Mapping[str, int] | Any, aspect: float = 2.0) -> MeshGrid:
    """Fold a mesh (axis -> size, or a Plan) into a grid about `aspect` times as wide as tall.

    Axes are taken innermost first (tp, cp, fsdp, dp, pp) and each goes to the columns or the
    rows, whichever keeps the grid's width / height nearer `aspect`.
    """
    sizes = {str(a): int(n) for a, n in dict(getattr(shape, "mesh_shape", shape)).items()}
    unknown = set(sizes) - {a.value for a in MESH_ORDER}
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {', '.join(a.value for a in MESH_ORDER)}")
    axes = tuple((a.value, sizes.get(a.value, 1)) for a in MESH_ORDER if sizes.get(a.value, 1) > 1)
    rows: list[str] = []
    cols: list[str] = []
    r = c = 1
    for a, n in reversed(axes):
        if abs(math.log(c * n / r / aspect)) <= abs(math.log(c / (r * n) / aspect)):
            cols.insert(0, a)
            c *= n
        else:
            rows.insert(0, a)
            r *= n
    return MeshGrid(shape=axes, row_axes=tuple(rows), col_axes=tuple(cols))


def comm_links(comms: Iterable[CommRecord] | None) -> dict[str, dict[tuple[int, ...], int]]:
    """axis -> {group (sorted ranks) -> bytes its members issued on it}, over the records given.

    A collective counts once per issuing member under its group; a send counts under the pair
    (rank, peer) on its axis; a recv is counted only through its send (same convention as
    viz.comms: the transfer once).
    """
    out: dict[str, dict[tuple[int, ...], int]] = defaultdict(lambda: defaultdict(int))
    for c in comms or ():
        if not isinstance(c, CommRecord):
            raise TypeError(f"expected CommRecord records, got a {type(c).__name__}")
        if c.op == "recv" or c.op == "barrier":
            continue
        if c.op == "send":
            if c.peer is None:
                continue
            group = tuple(sorted((c.rank, c.peer)))
        else:
            group = tuple(sorted(c.group))
        if len(group) > 1:
            out[c.axis or "world"][group] += c.bytes
    return {a: dict(g) for a, g in out.items()}


def _holding(shards: list[ShardRecord], param: str | None) -> tuple[str | None, dict[int, ShardRecord]]:
    if not shards:
        return None, {}
    names = sorted({s.param for s in shards})
    param = param if param is not None else names[0]
    return param, {s.rank: s for s in shards if s.param == param}


def _holds(rec: ShardRecord | None, param: str) -> str:
    if rec is None:
        return f"{param}: not held here"
    index = ", ".join(f"{a}:{b}" for a, b in rec.index)
    how = ", ".join(f"{a}: {p}" for a, p in zip(rec.mesh_axes, rec.placements)) or "whole"
    stage = f", stage {rec.stage}" if rec.stage is not None else ""
    return f"{param} {tuple(rec.global_shape)}: [{index}] = {tuple(rec.local_shape)}{stage}<br>  ({how})"


def _mem(rec: MemoryRecord | None, what: str) -> str:
    if rec is None:
        return ""
    total = rec.params + rec.grads + rec.optimizer + (rec.activations or 0)
    return (f"{what}: {human_bytes(total)} (params {human_bytes(rec.params)}, grads {human_bytes(rec.grads)}, "
            f"optimizer {human_bytes(rec.optimizer)}, activations {human_bytes(rec.activations or 0)})")


def mesh_figure(shape: Mapping[str, int] | Any, *, memory: Iterable[MemoryRecord] | None = None,
                predicted: Iterable[MemoryRecord] | None = None, shards: Iterable[ShardRecord] | None = None,
                param: str | None = None, comms: Iterable[CommRecord] | None = None, source: str = "",
                focus: int = 0, aspect: float = 2.0, num_experts: int = 0, num_layers: int = 0) -> go.Figure:
    """The mesh of `shape` (axis -> size, or a Plan): a heatmap of ranks coloured by memory
    (measured, else predicted, else uniform), hover text per rank, one line trace per mesh
    axis linking the members of each communication group (named `tp: 1.2 GiB/rank`): every
    group up to ALL_LINKS ranks, else the groups of rank `focus`. With `num_experts` and a Plan
    under expert parallelism, the ranks are coloured by the experts they hold (the same ids in
    every MoE layer) and each cell names them. With `num_layers` and a Plan under pipeline
    parallelism, each cell names the stages its rank holds and their decoder layers (uneven
    splits show as different ranges)."""
    grid = mesh_grid(shape, aspect)
    experts_held = _experts_held(shape, grid.world, num_experts)
    stages_held = _stages_held(shape, grid.world, num_layers)
    title = "Device mesh" + (f" ({source})" if source else "")
    if grid.world <= 1:
        return empty_figure(title, text="a single rank: no mesh")
    measured = latest_per_rank(records_of(memory, MemoryRecord))
    pred = latest_per_rank(records_of(predicted, MemoryRecord))
    param, held = _holding(records_of(shards, ShardRecord), param)
    colour_by = measured or pred
    most = max((r.params + r.grads + r.optimizer + (r.activations or 0) for r in colour_by.values()), default=0)
    unit, unit_name = (1024 ** 3, "GiB") if most >= 1024 ** 3 else (1024 ** 2, "MiB")
    z, text, hover = _cells(grid, unit, measured, pred, stages_held, experts_held, param, held)
    fig = go.Figure(go.Heatmap(
        z=z, text=text, customdata=hover, hovertemplate="%{customdata}<extra></extra>",
        texttemplate="%{text}" if grid.world <= TEXT_CELLS else None, textfont=dict(size=9),
        colorscale=[[0, "#f7fbff"], [1, "#6baed6"]] if not experts_held else "Viridis",
        showscale=bool(colour_by) and not experts_held, zmin=0,
        colorbar=dict(title=unit_name + (" measured" if measured else " predicted" if pred else "")),
        xgap=1, ygap=1))
    links = comm_links(comms)  # streamed: a dry run's comms of 1,024 ranks need not be a list
    only = None if grid.world <= ALL_LINKS else focus
    _draw_links(fig, grid, links, only)
    note = f"links: the groups of rank {focus}" if only is not None and links else ""
    styled(fig, _title(title, grid, param, note), _axis_title(grid.col_axes), _axis_title(grid.row_axes),
           above=TOP_AXIS_PX, hovermode="closest", plot_bgcolor="white", legend=dict(orientation="h", y=-0.08),
           height=int(max(380, min(1200, 900 * grid.rows / grid.cols + 220))))
    cols, rows = _ticks(grid, grid.col_axes), _ticks(grid, grid.row_axes)
    fig.update_xaxes(showgrid=False, zeroline=False, side="top", range=[-0.5, grid.cols - 0.5],
                     tickvals=list(range(0, grid.cols, _every(grid.cols))), ticktext=cols[::_every(grid.cols)])
    fig.update_yaxes(showgrid=False, zeroline=False, autorange="reversed",
                     tickvals=list(range(0, grid.rows, _every(grid.rows))), ticktext=rows[::_every(grid.rows)])
    return fig


def _cells(grid: MeshGrid, unit: int, measured: dict[int, MemoryRecord], pred: dict[int, MemoryRecord],
           stages_held: dict, experts_held: dict, param: str | None,
           held: dict[int, ShardRecord]) -> tuple[list[list], list[list[str]], list[list[str]]]:
    """What each cell of the grid shows: (its colour value: memory in `unit`s, measured else
    predicted, or the experts held; its text: rank, coordinates, stages or experts; its hover:
    those, what it holds of `param`, and its predicted and measured memory)."""
    colour_by = measured or pred
    z = [[None] * grid.cols for _ in range(grid.rows)]
    text = [[""] * grid.cols for _ in range(grid.rows)]
    hover = [[""] * grid.cols for _ in range(grid.rows)]
    for rank in range(grid.world):
        row, col = grid.cell(rank)
        label = " ".join(f"{a}{v}" for a, v in grid.coords(rank).items())
        rec = colour_by.get(rank)
        z[row][col] = (rec.params + rec.grads + rec.optimizer + (rec.activations or 0)) / unit if rec else 0.0
        text[row][col] = f"{rank}<br>{label}"
        lines = [f"rank {rank}: {label}"]
        if rank in stages_held:
            note, line = stages_held[rank]
            text[row][col] += note
            lines.append(line)
        if experts_held:  # coloured by the experts held, in place of memory
            z[row][col], note, line = experts_held[rank]
            text[row][col] += note
            lines.append(line)
        if param is not None:
            lines.append(_holds(held.get(rank), param))
        lines += [s for s in (_mem(pred.get(rank), "predicted"), _mem(measured.get(rank), "measured")) if s]
        hover[row][col] = "<br>".join(lines)
    return z, text, hover


def _experts_held(shape: Any, world: int, num_experts: int) -> dict[int, tuple[int, str, str]]:
    """rank -> (its ep rank, the cell's note, the hover line) under a Plan with ep > 1, else {}."""
    ep = getattr(shape, "ep", 1)
    if ep <= 1 or not num_experts or not hasattr(shape, "mesh_shape"):
        return {}
    local = num_experts // ep
    out = {}
    for rank in range(world):
        ep_rank = expert_coords(rank, shape.mesh_shape, ep)[1]
        lo, hi = ep_rank * local, (ep_rank + 1) * local - 1
        out[rank] = (ep_rank, f"<br>E{lo}-{hi}", f"holds experts {lo}..{hi} of every MoE layer (ep rank {ep_rank})")
    return out


def _stages_held(shape: Any, world: int, num_layers: int) -> dict[int, tuple[str, str]]:
    """rank -> (the cell's note, the hover line) naming its pipeline stages and their decoder
    layers, under a Plan with pp > 1, else {}."""
    if getattr(shape, "pp", 1) <= 1 or not num_layers or not hasattr(shape, "stage_ids"):
        return {}
    extra = {0: " + embedding", shape.n_stages - 1: " + norm, head"}
    per_pp_rank = {}  # every rank of one pipeline coordinate holds the same stages
    for pp_rank in range(shape.pp):
        spans = []
        for s in shape.stage_ids(pp_rank):
            ids = shape.stage_layer_ids(num_layers, s)
            spans.append((s, f"L{ids[0]}-{ids[-1]}" if ids else "no layers", len(ids)))
        note = "<br>" + " ".join(f"S{s}:{span}" for s, span, _ in spans)
        line = "; ".join(f"stage {s}: {n} layers ({span}{extra.get(s, '')})" for s, span, n in spans)
        per_pp_rank[pp_rank] = (note, line)
    return {rank: per_pp_rank[mesh_coords(rank, shape.mesh_shape)[MeshAxis.PP]] for rank in range(world)}


def _every(count: int) -> int:
    return max(1, math.ceil(count / MAX_TICKS))


def _axis_title(axes: tuple[str, ...]) -> str:
    return " x ".join(axes) if axes else ""


def _title(head: str, grid: MeshGrid, param: str | None, note: str) -> str:
    dims = " x ".join(f"{a} {n}" for a, n in grid.shape)
    parts = [f"{grid.world} ranks ({dims})", f"hover: {param}" if param else "", note]
    parts = [p for p in parts if p]
    return title_lines(f"{head}:", *[p + ";" for p in parts[:-1]], parts[-1])


def _ticks(grid: MeshGrid, axes: tuple[str, ...]) -> list[str]:
    sizes = dict(grid.shape)
    count = math.prod(sizes[a] for a in axes) if axes else 1
    out = []
    for i in range(count):
        parts, rest = [], i
        for a in reversed(axes):
            parts.insert(0, f"{a}{rest % sizes[a]}")
            rest //= sizes[a]
        out.append(" ".join(parts))
    return out


BEND = {"tp": 0.18, "cp": 0.26, "fsdp": 0.34, "dp": 0.42, "pp": 0.5}
"""How far a link bows out of the straight line, per axis (a share of its length): links of
different axes between the same cells stay apart."""


def _arc(a: tuple[float, float], b: tuple[float, float], bend: float, points: int = 12) -> list[tuple[float, float]]:
    """A quadratic curve from a to b bowing `bend` x its length to one side (0: a straight line),
    at most two cells out."""
    (x0, y0), (x1, y1) = a, b
    scale = min(bend, 2.0 / max(math.hypot(x1 - x0, y1 - y0), 1e-9))
    mx, my = (x0 + x1) / 2 - scale * (y1 - y0), (y0 + y1) / 2 + scale * (x1 - x0)
    return [((1 - t) ** 2 * x0 + 2 * (1 - t) * t * mx + t * t * x1, (1 - t) ** 2 * y0 + 2 * (1 - t) * t * my + t * t * y1)
            for t in (i / points for i in range(points + 1))]


def _draw_links(fig: go.Figure, grid: MeshGrid, links: dict[str, dict[tuple[int, ...], int]],
                only: int | None) -> None:
    """One trace per axis: every group (or those of rank `only`) as a ring through its members
    (a pair: one arc); the width and the legend give the bytes per member and step of the groups
    drawn (rank `only`'s groups: that rank's own traffic, as the title says, not every rank's mean)."""
    if not links:
        return
    links = {axis: drawn for axis, groups in links.items()
             if (drawn := {g: b for g, b in groups.items() if only is None or only in g})}
    if not links:
        return
    per_rank = {axis: sum(groups.values()) / max(1, len({r for g in groups for r in g}))
                for axis, groups in links.items()}
    top = max(per_rank.values()) or 1
    for axis in sorted(links, key=lambda a: -per_rank[a]):
        name = axis.split("_")[0]
        xs: list[float | None] = []
        ys: list[float | None] = []
        for group in links[axis]:
            ring = list(group) + ([group[0]] if len(group) > 2 else [])
            for a, b in zip(ring, ring[1:]):
                (ra, ca), (rb, cb) = grid.cell(a), grid.cell(b)
                for x, y in _arc((ca, ra), (cb, rb), BEND.get(name, 0.3)):
                    xs.append(x)
                    ys.append(y)
                xs.append(None)
                ys.append(None)
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines", name=f"{axis}: {human_bytes(per_rank[axis])}/rank",
            line=dict(color=AXIS_COLORS.get(name, OP_COLORS.get(name, "#555")),
                      width=1 + 5 * math.sqrt(per_rank[axis] / top)),
            opacity=0.7, hoverinfo="name"))
