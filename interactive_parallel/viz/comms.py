"""Communication volume from CommRecords: a rank-by-rank matrix and a per-axis, per-op breakdown.

Owns the counting convention (below) and its two figures. Knows nothing of how the records were
captured (runtime/ probes), of wire algorithms (ring versus tree), nor of torch, ipyparallel or widgets.

Counting convention ("bytes sent", the logical payload, not the bytes a ring algorithm puts on a link):

- send: `bytes` go from `rank` to `peer`.
- recv: the other end of a send. It is not counted when the matching send record (same step,
  from `peer` to `rank`) is present, so a transfer probed on both sides counts once; a recv
  whose send is absent counts as `peer` -> `rank`. A send/recv without a peer is not counted.
- a collective (all_reduce, all_gather, ...): the issuing rank's `bytes` are split evenly over the
  other members of `group` (all ranks seen in the records when `group` is empty); a group of one
  sends nothing.

So the matrix sums to the bytes of the counted records (minus collectives of one member), and the
breakdown counts the same records.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import plotly.graph_objects as go

from ..plan.axes import MESH_ORDER
from ..records import CommRecord
from ._common import OP_COLORS, empty_figure, human_bytes, records_of, styled, title_lines

P2P = ("send", "recv")


def counted(comms: Iterable[CommRecord]) -> list[CommRecord]:
    """The records the convention counts: all but the recvs whose send is also recorded."""
    comms = list(comms)
    sends = {(c.step, c.rank, c.peer) for c in comms if c.op == "send"}
    return [c for c in comms if not (c.op == "recv" and (c.step, c.peer, c.rank) in sends)]


def comm_matrix(comms: Iterable[CommRecord] | None) -> tuple[list[int], list[list[float]]]:
    """(ranks, matrix) with matrix[i][j] the bytes rank i sent to rank j, by the module's convention.

    `ranks` is 0..max rank seen (as issuer, peer or group member), so matrix[i][j] is indexed by rank.
    """
    recs = records_of(comms, CommRecord)
    seen = {c.rank for c in recs}
    seen |= {c.peer for c in recs if c.peer is not None}
    seen |= {m for c in recs for m in c.group}
    if not seen:
        return [], []
    n = max(seen) + 1
    matrix = [[0.0] * n for _ in range(n)]
    world = sorted(seen)
    for c in counted(recs):
        if c.op in P2P:
            if c.peer is None:
                continue
            src, dst = (c.rank, c.peer) if c.op == "send" else (c.peer, c.rank)
            matrix[src][dst] += c.bytes
            continue
        others = [m for m in (c.group or world) if m != c.rank]
        for m in others:
            matrix[c.rank][m] += c.bytes / len(others)
    return list(range(n)), matrix


def comm_matrix_figure(comms: Iterable[CommRecord] | None) -> go.Figure:
    """Heatmap of bytes sent from rank (row) to rank (column); see the module docstring for how
    send/recv and collectives are attributed."""
    ranks, matrix = comm_matrix(comms)
    title, xt, yt = "Bytes sent rank to rank, full buffers", "to rank", "from rank"
    if not ranks:
        return empty_figure(title, xt, yt)
    labels = [f"rank {r}" for r in ranks]
    total = sum(map(sum, matrix))
    fig = go.Figure(go.Heatmap(
        z=matrix, x=labels, y=labels, colorscale="Blues", colorbar=dict(title=dict(text="bytes")),
        text=[[human_bytes(v) if v else "" for v in row] for row in matrix], texttemplate="%{text}",
        hovertemplate="%{y} → %{x}: %{z:,.0f} B<extra></extra>", xgap=1, ygap=1))
    styled(fig, title_lines(title, f"(total {human_bytes(total)})"), xt, yt)
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category", side="bottom")
    return fig


def axis_label(axis: str) -> str:
    return axis or "world"


def _axis_order(axes: Iterable[str]) -> list[str]:
    known = [str(a) for a in MESH_ORDER]
    rank = {a: i for i, a in enumerate(known + ["world"])}
    return sorted(set(axes), key=lambda a: (rank.get(a, len(rank)), a))


def comm_breakdown(comms: Iterable[CommRecord] | None) -> dict[tuple[str, str], int]:
    """(mesh axis, op) -> bytes of the counted records (axis '' reads as 'world')."""
    sums: dict[tuple[str, str], int] = defaultdict(int)
    for c in counted(records_of(comms, CommRecord)):
        sums[(axis_label(c.axis), c.op)] += c.bytes
    return dict(sums)


def comm_breakdown_figure(comms: Iterable[CommRecord] | None) -> go.Figure:
    """Stacked bars: x = mesh axis, one trace (colour) per op, height = bytes summed over ranks."""
    sums = comm_breakdown(comms)
    title, xt, yt = "Bytes by mesh axis and op, full buffers", "mesh axis", "bytes"
    if not sums:
        return empty_figure(title, xt, yt)
    axes = _axis_order(a for a, _ in sums)
    ops = sorted({op for _, op in sums}, key=lambda o: (list(OP_COLORS).index(o) if o in OP_COLORS
                                                        else len(OP_COLORS), o))
    fig = go.Figure()
    for op in ops:
        values = [sums.get((a, op), 0) for a in axes]
        fig.add_trace(go.Bar(
            x=axes, y=values, name=op, marker_color=OP_COLORS.get(op),
            customdata=[human_bytes(v) for v in values],
            hovertemplate=f"%{{x}} {op}: %{{customdata}} (%{{y:,}} B)<extra></extra>"))
    total = sum(sums.values())
    styled(fig, title_lines(title, f"(total {human_bytes(total)})"), xt, yt, barmode="stack")
    fig.update_xaxes(type="category")
    return fig
