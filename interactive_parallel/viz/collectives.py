"""Each rank's latest collectives on one process group, as lanes, the first mismatch marked.

Owns the figure of `Session.collectives()` (or the records a timed-out call's error was built
from): one lane per rank of a group, a mark per collective at its sequence number (colour: the
op; hover: sizes, state, the frame that issued it), and, where the ranks first disagree
(records.stacks.first_mismatch), a line at that number with the ranks that never issued it
named. A hang reads at a glance: the peers' lanes reach the line, the lane that stops short is
the rank they wait for. Knows nothing of torch, of how the records were read, or of the groups
it does not draw.
"""
from __future__ import annotations

from typing import Iterable

import plotly.graph_objects as go

from ..records.stacks import CollectiveRecord, first_mismatch, groups_of
from ._common import OP_COLORS, PALETTE, records_of, styled, title_lines

NO_COLLECTIVES = "no collectives recorded: ask s.collectives() while the ranks run or hang"


def _chosen(collectives: list[CollectiveRecord], group: str | None) -> tuple | None:
    """(group, members, p2p) to draw: the one named, else that of the first mismatch, else the world."""
    keys = sorted(groups_of(collectives), key=lambda k: (k[2], k[0] != "world", k))
    if group is not None:
        keys = [k for k in keys if k[0] == group]
        if not keys:
            known = sorted({k[0] for k in groups_of(collectives)})
            raise ValueError(f"group {group!r} has no collectives here: groups are {', '.join(known)}")
    found = first_mismatch([c for c in collectives if (c.group, tuple(c.ranks), c.p2p) in keys])
    if found is not None:  # a group that did not say its members is keyed by ()
        return next(k for k in keys if k[0] == found.group and k[2] == found.p2p and k[1] in (found.members, ()))
    return keys[0] if keys else None


def collective_lanes_figure(collectives: Iterable[CollectiveRecord] | None, group: str | None = None) -> go.Figure:
    """Lanes (one per rank) of a group's latest collectives by sequence number; `group` names the
    group ('dp', 'tp', ...), by default the one the ranks first disagree on (else the world's)."""
    recs = records_of(collectives, CollectiveRecord)
    key = _chosen(recs, group)
    fig = go.Figure()
    if key is None:
        fig.add_annotation(text=NO_COLLECTIVES, showarrow=False)
        return styled(fig, title_lines("Latest collectives per rank"), "", "")
    per_rank = groups_of(recs)[key]
    ops = sorted({c.op for seqs in per_rank.values() for c in seqs.values()})
    for i, op in enumerate(ops):
        mine = [c for r in sorted(per_rank) for c in per_rank[r].values() if c.op == op]
        fig.add_trace(go.Scatter(
            x=[c.seq for c in mine], y=[f"rank {c.rank}" for c in mine], mode="markers", name=op,
            marker=dict(symbol="square", size=12, color=OP_COLORS.get(op, PALETTE[i % len(PALETTE)])),
            text=[f"{c.op} {c.in_sizes} {c.dtype}<br>{c.state}<br>{c.where}" for c in mine],
            hovertemplate="%{y}, #%{x}: %{text}<extra></extra>"))
    found = first_mismatch([c for seqs in per_rank.values() for c in seqs.values()])
    what = f"{key[0]} {list(key[1])}" + (" point-to-point" if key[2] else "")
    if found is not None:
        fig.add_vline(x=found.seq, line_dash="dash", line_color="#d62728")
        named = (f"rank(s) {sorted(found.behind)} never issued #{found.seq}" if found.behind
                 else f"ranks differ at #{found.seq}")
        fig.add_annotation(x=found.seq, y=1.0, yref="paper", text=named, showarrow=False, yanchor="bottom",
                           font=dict(color="#d62728"))
    fig.update_yaxes(categoryorder="array", categoryarray=[f"rank {r}" for r in sorted(per_rank, reverse=True)])
    title = title_lines(f"Latest collectives on {what},", "one lane per rank"
                        + (", first mismatch marked" if found is not None else ""))
    return styled(fig, title, "sequence number (as torch's flight recorder counts the group's collectives)", "rank",
                  above=20)
