"""Ring context parallel, round by round: which rank's K/V block each rank holds in each round.

Owns the reading of a ring from comm records alone (no round index travels: the rounds are the
order of a rank's point-to-point receives on the cp axis) and its figure. Round 0 is every
rank's own block; in round i a rank holds the block its peer (the rank it received from) held
in round i-1. Only the first layer's forward is read: its cp-1 receives come first in a step
(the cp group's size, from the records, gives cp). Knows nothing of torch or of the attention.
"""
from __future__ import annotations

from typing import Iterable

import plotly.graph_objects as go

from ..records import CommRecord
from ._common import EMPTY_TEXT, human_bytes, styled, title_lines


def ring_rounds(comms: Iterable[CommRecord] | None, step: int | None = None) -> dict[int, list[tuple[int, int]]]:
    """{rank: [(owner of the K/V block held, bytes received for it) per round]} of the first
    layer's forward of `step` (the first step recorded if None); {} without ring receives."""
    recvs = [c for c in (comms or []) if c.op == "recv" and c.axis == "cp" and c.peer is not None]
    if not recvs:
        return {}
    step = min(c.step for c in recvs) if step is None else step
    by_rank: dict[int, list[CommRecord]] = {}
    for c in recvs:
        if c.step == step:
            by_rank.setdefault(c.rank, []).append(c)
    cp = max(len(c.group) for c in recvs)
    rounds = {r: [(r, 0)] for r in by_rank}
    for i in range(1, cp):
        for r, recs in sorted(by_rank.items()):
            if len(recs) >= i and recs[i - 1].peer in rounds and len(rounds[recs[i - 1].peer]) >= i:
                rounds[r].append((rounds[recs[i - 1].peer][i - 1][0], recs[i - 1].bytes))
    return dict(sorted(rounds.items()))


def ring_rounds_figure(comms: Iterable[CommRecord] | None, step: int | None = None) -> go.Figure:
    """A grid: rank (rows) x round (columns), each cell the rank whose K/V block is held there."""
    rounds = ring_rounds(comms, step)
    fig = go.Figure()
    if not rounds:
        fig.add_annotation(text=EMPTY_TEXT + " (under a cp_method='ring' plan)", showarrow=False)
        return styled(fig, title_lines("Ring CP rounds"), "", "")
    ranks = list(rounds)
    width = max(len(v) for v in rounds.values())
    z = [[rounds[r][i][0] if i < len(rounds[r]) else None for i in range(width)] for r in ranks]
    text = [[f"K/V of rank {rounds[r][i][0]}" + (f"<br>{human_bytes(rounds[r][i][1])} in" if rounds[r][i][1] else
                                                   "<br>its own")
             if i < len(rounds[r]) else "" for i in range(width)] for r in ranks]
    fig.add_trace(go.Heatmap(z=z, x=[f"round {i}" for i in range(width)], y=[f"rank {r}" for r in ranks],
                             text=text, texttemplate="%{text}", colorscale="Viridis", showscale=False,
                             hovertemplate="%{y}, %{x}: %{text}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    title = title_lines("Ring CP: whose K/V block each rank holds,", "round by round (first layer's forward)")
    return styled(fig, title, "round", "rank")
