"""A click on a block of the layout view's map fetches it: the clicked rank's block of the parameter
shown (`session.fetch`), as shape, dtype, norm, min, max, mean and a small preview, beside the map.

Owns binding plotly's click callbacks to the sharding FigureWidget's traces (again after every
draw: a redraw that replaces the traces drops their callbacks) and the HTML of a fetched block.
viz.sharding_figure draws one trace per distinct block, in viz.shard_regions' order, so a click
on trace i is a click on region i, fetched from its first holding rank. Knows nothing of how the
map is drawn, nor of torch: the tensor's own methods make the statistics and the preview.
"""
from __future__ import annotations

from typing import Any, Callable

import ipywidgets as W
import plotly.graph_objects as go

from .. import viz
from ._common import SessionRef, css, describe_error
from .render import esc, note, pre, table

PREVIEW = 4
"""Rows and columns of a block shown (a tensor of more dims has its trailing dims flattened, as the map does)."""
HINT = "click a block of the map to fetch it from its rank: shape, dtype, statistics, a preview"


def _preview(tensor: Any) -> str:
    t = tensor.detach().float()
    t = t.reshape(1, -1) if t.dim() <= 1 else t.reshape(t.shape[0], -1)
    lines = [" ".join(f"{v:>10.4g}" for v in row[:PREVIEW]) + (" ..." if t.shape[1] > PREVIEW else "")
             for row in t[:PREVIEW].tolist()]
    lines += ["..."] if t.shape[0] > PREVIEW else []
    return f"<div>{note(f'its first {PREVIEW} rows and columns')}</div>{pre(chr(10).join(lines))}"


def block_html(fetched: Any, holders: list[int]) -> str:
    """What a reader needs of one rank's block: where it sits, what it holds, a corner of its values."""
    rec = fetched.shards[0]
    spans = ", ".join(f"{a}:{b}" for a, b in rec.index)
    where = ", ".join(f"{a}: {p}" for a, p in zip(rec.mesh_axes, rec.placements)) or "plain tensor"
    same = f" (the same block on ranks {', '.join(map(str, holders))})" if len(holders) > 1 else ""
    stats = fetched.stats()
    rows = [("parameter", fetched.name), ("rank", f"{fetched.rank}{same}"),
            ("coords", ", ".join(f"{k}={v}" for k, v in rec.coords.items()) or "-"), ("placements", where),
            ("index", f"[{spans}] of {tuple(rec.global_shape)}"), ("shape", str(fetched.shape)),
            ("dtype", str(fetched.dtype).replace("torch.", ""))]
    rows += [(k, f"{v:.6g}") for k, v in stats.items()]
    return f"<b>{esc(fetched.what)} block</b>{table(('', ''), rows)}{_preview(fetched.tensor)}"


class ShardPeek:
    """The HTML beside the layout map and the clicks that fill it (see the module docstring)."""

    def __init__(self, figure: go.FigureWidget, session: SessionRef, shown: Callable[[], tuple[str | None, list]],
                 busy: Callable[[], bool], dry: Callable[[], Any]):
        """`shown`: the parameter the map shows and the shards it was drawn from; `dry`: the kept dry run
        while dry-run mode is on (its blocks hold no values)."""
        self.figure, self.session, self.shown, self.busy, self.dry = figure, session, shown, busy, dry
        self.html = css(W.HTML(note(HINT)), "ip-shard-peek")

    def bind(self) -> None:
        """Give every trace of the map its click callback (replacing any it had)."""
        for i, trace in enumerate(self.figure.data):
            trace.on_click(lambda _trace, points, _state, i=i: self._clicked(i, points))
        self.html.value = note(HINT)

    def _clicked(self, index: int, points: Any) -> None:
        if points.point_inds:  # plotly calls every trace's callback; the clicked one gets the points
            self.show(index)

    def show(self, index: int) -> None:
        """Fetch the block of the map's `index`-th region from its first holding rank and show it."""
        try:
            self.html.value = self._fetched(index)
        except Exception as exc:  # noqa: BLE001 - a view must never break the panel
            self.html.value = pre(describe_error(exc, "fetch"))

    def _fetched(self, index: int) -> str:
        if self.dry() is not None:
            return note("a dry run's blocks hold no values: leave dry-run mode to fetch a rank's block")
        param, shards = self.shown()
        regions = viz.shard_regions(shards, param) if param else []
        if not 0 <= index < len(regions):
            return note(HINT)
        if self.busy():
            return note("the ranks are busy: click again when they have finished")
        holders = [r.rank for r in regions[index][1]]
        return block_html(self.session.require().fetch(param, holders[0]), holders)
