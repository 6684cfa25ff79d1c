"""Why each collective happened, drawn: a treemap of a step's collectives by their cause.

Owns the figure of the "why" tree (records/comm_tree.py groups the records: module -> the op
that needed collectives -> the collective, op and axis or placements): a tile per node sized by
its bytes (by its count when nothing moved bytes), hover with count, bytes, axis, placements,
phase and ranks, each collective tile in its op's colour and each implicit redistribute (and
every node above one) in red, so a placement mismatch stands out. Knows nothing of how causes
are read (runtime/probes/causes.py), nor of torch, ipyparallel or widgets.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import plotly.graph_objects as go

from ..records import CommNode, CommRecord, comm_tree
from ._common import OP_COLORS, TEMPLATE, empty_figure, human_bytes, records_of, title_layout, title_lines, top_margin

TITLE = "Why each collective: module, op, collective"
IMPLICIT = "#d62728"
"""An implicit redistribute's tile (no op's colour is red)."""
HOLDS_IMPLICIT = "#f4c7c3"
"""A module or op with an implicit redistribute under it."""
INNER = "#e8ecf1"
"""A module or op tile."""
ROOT = "all collectives"


def comm_tree_nodes(items: Iterable[Any] | None, rank: int | None = None) -> list[CommNode]:
    """The tree's nodes: `items` themselves when they are CommNodes (Session.explain_comms,
    DryRun.explain_comms), else the CommRecords among them grouped (records.comm_tree)."""
    items = list(items or ())
    nodes = [x for x in items if isinstance(x, CommNode)]
    return nodes or list(comm_tree(records_of(items, CommRecord), rank=rank))


def _hover(n: CommNode) -> str:
    lines = [f"<b>{n.label}</b>", f"{human_bytes(n.bytes)} ({n.bytes:,} B) in {n.count} collective"
             + ("s" if n.count != 1 else "")]
    lines.append(f"axis: {n.axis}" + (f"; {n.placements}" if n.placements else ""))
    if n.implicit:
        lines.append(f"implicit redistributes: {n.implicit} (a placement mismatch at {n.needed_by or 'an op'})")
    lines.append(f"phase: {n.phase or '-'}; " + (f"rank {n.rank}" if n.rank is not None else f"{n.ranks} ranks"))
    return "<br>".join(lines)


def _color(n: CommNode) -> str:
    if n.depth == 2:
        return IMPLICIT if n.implicit else OP_COLORS.get(n.op, "#7f7f7f")
    return HOLDS_IMPLICIT if n.implicit else INNER


def comm_tree_figure(items: Iterable[Any] | None, rank: int | None = None) -> go.Figure:
    """Treemap of the "why" tree of `items` (CommRecords, grouped here; or the CommNodes of an
    explain_comms call): summed over ranks, or `rank`'s alone. Tile ids are the nodes' paths
    under one root; `customdata` holds each node's count and its bytes as text."""
    nodes = comm_tree_nodes(items, rank)
    if not nodes:
        return empty_figure(TITLE)
    tops = [n for n in nodes if n.depth == 0]
    total, count = sum(n.bytes for n in tops), sum(n.count for n in tops)
    implicit = sum(n.implicit for n in tops)
    by_bytes = total > 0
    which = f"rank {nodes[0].rank}" if nodes[0].rank is not None else "every rank summed"
    sub = f"({count} collectives, {human_bytes(total)}, {which}" + (f"; {implicit} implicit, red)" if implicit else ")")
    size = (lambda n: n.bytes) if by_bytes else (lambda n: n.count)
    fig = go.Figure(go.Treemap(
        ids=[ROOT] + [n.path for n in nodes], labels=[ROOT] + [n.label for n in nodes],
        parents=[""] + [n.parent or ROOT for n in nodes],
        values=[total if by_bytes else count] + [size(n) for n in nodes],
        branchvalues="total",
        customdata=[[count, human_bytes(total)]] + [[n.count, human_bytes(n.bytes)] for n in nodes],
        hovertext=[f"<b>{ROOT}</b><br>{human_bytes(total)} in {count} collectives"] + [_hover(n) for n in nodes],
        hovertemplate="%{hovertext}<extra></extra>",
        texttemplate="%{label}<br>" + ("%{customdata[1]}" if by_bytes else "%{customdata[0]} collectives"),
        marker=dict(colors=["white"] + [_color(n) for n in nodes], line=dict(width=1, color="white")),
        root=dict(color="white"), sort=False))
    title = title_lines(TITLE, sub + ("" if by_bytes else " sized by count: no bytes moved"))
    fig.update_layout(template=TEMPLATE, title=title_layout(title), margin=dict(t=top_margin(title), l=4, r=4, b=4))
    return fig
