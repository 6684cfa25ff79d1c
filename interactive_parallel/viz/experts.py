"""Mixture-of-experts routing from ExpertRecords: the load per expert, the tokens moved between
expert-parallel ranks, and the load imbalance over steps.

Owns the counting convention (below) and its three figures. Knows nothing of how the counts were
taken (runtime/parallel/ep.py), of torch, ipyparallel or widgets.

Counting convention (a count is a (token, slot) pair: a token routed to top_k experts counts top_k times):

- load: the pairs each expert processed, `tokens` summed over ranks by global expert id
  (`experts`). Under ep every rank processes its own share (tp ranks each their slice of the
  tokens), so every record counts; without ep every tp rank processes the same tokens, so only
  records with tp_rank 0 count. Either way a layer's load sums to its global tokens x top_k.
- moved: `sent[i]` pairs go from `rank` to `ep_group[i]` (received is the other end, not counted
  again). The diagonal is what a rank routed to its own experts: nothing crosses a link for it.
- imbalance: max / mean over a layer's experts (1.0 perfectly balanced; 1.0 when nothing was routed).

Accepts ExpertRecords, or StepRecords (their `experts` are read), or a mix.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go

from ..records import ExpertRecord, StepRecord
from ._common import empty_figure, human_bytes, rank_color, records_of, styled, title_lines

NO_EXPERTS_TEXT = "no mixture-of-experts records"
NO_EP_TEXT = "no tokens moved: expert parallelism is off (ep = 1)"


def expert_records(records: Iterable[Any] | None) -> list[ExpertRecord]:
    """The ExpertRecords in `records`, those that StepRecords carry included."""
    if records is None:
        return []
    items: list[Any] = []
    for r in records:
        items += r.experts if isinstance(r, StepRecord) else [r]
    return records_of(items, ExpertRecord) if items else []  # no items: none, or a dense model's steps


def _of_step(records: Iterable[Any] | None, step: int | None) -> tuple[list[ExpertRecord], int | None]:
    """(the records of `step`, latest by default; that step) (None: no records at all)."""
    recs = expert_records(records)
    if not recs:
        return [], None
    step = max(r.step for r in recs) if step is None else step
    return [r for r in recs if r.step == step], step


def _counts(r: ExpertRecord) -> bool:
    """Whether `r`'s `tokens` count towards the load (see the module docstring)."""
    return len(r.ep_group) > 1 or bool(r.sent) or r.tp_rank == 0


def _load_of(recs: Sequence[ExpertRecord]) -> dict[int, list[int]]:
    n = max((max(len(r.routed), max(r.experts, default=-1) + 1) for r in recs), default=0)
    loads: dict[int, list[int]] = {}
    for r in sorted(recs, key=lambda r: r.layer):
        row = loads.setdefault(r.layer, [0] * n)
        if _counts(r):
            for e, t in zip(r.experts, r.tokens):
                row[e] += t
    return loads


def expert_load(records: Iterable[Any] | None, step: int | None = None) -> dict[int, list[int]]:
    """Layer -> pairs each expert (by global id) processed in `step` (the latest by default)."""
    recs, _ = _of_step(records, step)
    return _load_of(recs)


def imbalance(loads: dict[int, Sequence[int]] | Sequence[int]) -> float:
    """max / mean over experts: of one layer's loads, or of the worst layer of a dict of them."""
    if isinstance(loads, dict):
        return max((imbalance(v) for v in loads.values()), default=1.0)
    mean = sum(loads) / len(loads) if len(loads) else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def expert_load_figure(records: Iterable[Any] | None, step: int | None = None) -> go.Figure:
    """Heatmap of the pairs each expert (x) of each MoE layer (y) processed in one step (the latest
    by default); the title names the step and the worst layer's imbalance, hover each layer's."""
    recs, step = _of_step(records, step)
    title, xt, yt = "Tokens per expert", "expert", "layer"
    if not recs:
        return empty_figure(title if step is None else f"{title}, step {step}", xt, yt, text=NO_EXPERTS_TEXT)
    loads = _load_of(recs)
    layers = sorted(loads)
    ratios = {layer: imbalance(loads[layer]) for layer in layers}
    worst = max(layers, key=lambda layer: ratios[layer])
    n = len(loads[worst])
    z = [loads[layer] for layer in layers]
    fig = go.Figure(go.Heatmap(
        z=z, x=[f"expert {e}" for e in range(n)], y=[f"layer {layer}" for layer in layers],
        colorscale="Oranges", colorbar=dict(title=dict(text="pairs")),
        customdata=[[ratios[layer]] * n for layer in layers], text=[[f"{v:,}" for v in row] for row in z],
        texttemplate="%{text}",
        hovertemplate="%{y}, %{x}: %{z:,} pairs<br>layer imbalance %{customdata:.2f}<extra></extra>",
        xgap=1, ygap=1))
    styled(fig, title_lines(f"{title}, step {step}",
                            f"(imbalance max/mean {ratios[worst]:.2f}, layer {worst})"), xt, yt)
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category")
    return fig


def tokens_moved(records: Iterable[Any] | None, layer: int | None = None,
                 step: int | None = None) -> dict[tuple[int, int], int]:
    """(sender rank, receiver rank) -> pairs sent in `step` (the latest by default), summed over
    layers unless `layer` is given; every pair of ep peers is present (0 when nothing went)."""
    recs, _ = _of_step(records, step)
    out: dict[tuple[int, int], int] = defaultdict(int)
    for r in recs:
        if layer is None or r.layer == layer:
            for peer, n in zip(r.ep_group, r.sent):
                out[(r.rank, peer)] += n
    return dict(out)


def tokens_moved_figure(records: Iterable[Any] | None, layer: int | None = None, step: int | None = None, *,
                        hidden_size: int | None = None, dtype_bytes: int | None = None) -> go.Figure:
    """Heatmap of the pairs each rank (row) sent to each ep peer's experts (column); with
    `hidden_size` and `dtype_bytes` also the bytes that implies (one hidden vector per pair, each
    way: the combine sends as many back)."""
    recs, step = _of_step(records, step)
    where = "all layers" if layer is None else f"layer {layer}"
    title, xt, yt = "Tokens sent to experts, rank to rank", "to rank", "from rank"
    if not recs:
        return empty_figure(title, xt, yt, text=NO_EXPERTS_TEXT)
    moved = tokens_moved(recs, layer)
    if not moved:
        return empty_figure(title_lines(title, f"(step {step}, {where})"), xt, yt, text=NO_EP_TEXT)
    ranks = sorted({r for pair in moved for r in pair})
    labels = [f"rank {r}" for r in ranks]
    z = [[moved.get((src, dst), 0) for dst in ranks] for src in ranks]
    per_pair = hidden_size * dtype_bytes if hidden_size and dtype_bytes else 0
    off_rank = sum(v for (src, dst), v in moved.items() if src != dst)

    def shown(v: int) -> str:
        return (f"{v:,}" + (f"<br>{human_bytes(v * per_pair)}" if per_pair else "")) if v else ""

    hover = "%{y} → %{x}: %{z:,} pairs" + (" (%{customdata})" if per_pair else "") + "<extra></extra>"
    fig = go.Figure(go.Heatmap(
        z=z, x=labels, y=labels, colorscale="Purples", colorbar=dict(title=dict(text="pairs")),
        text=[[shown(v) for v in row] for row in z], texttemplate="%{text}",
        customdata=[[human_bytes(v * per_pair) for v in row] for row in z] if per_pair else None,
        hovertemplate=hover, xgap=1, ygap=1))
    total = f"{off_rank:,} pairs off-rank" + (f", {human_bytes(off_rank * per_pair)} each way" if per_pair else "")
    styled(fig, title_lines(title, f"(step {step}, {where})", f"({total})"), xt, yt)
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category", side="bottom")
    return fig


def expert_load_over_steps_figure(records: Iterable[Any] | None, per_layer: bool = True) -> go.Figure:
    """The imbalance ratio (max / mean over experts) per step: one line per MoE layer, or with
    `per_layer` False one line of the worst layer's."""
    recs = expert_records(records)
    title, xt, yt = "Expert load imbalance per step", "step", "max / mean tokens per expert"
    if not recs:
        return empty_figure(title, xt, yt, text=NO_EXPERTS_TEXT)
    by_step: dict[int, list[ExpertRecord]] = defaultdict(list)
    for r in recs:
        by_step[r.step].append(r)
    steps = sorted(by_step)
    ratios = {s: {layer: imbalance(v) for layer, v in _load_of(by_step[s]).items()} for s in steps}
    lines: dict[str, list[float | None]]
    if per_layer:
        layers = sorted({layer for s in steps for layer in ratios[s]})
        lines = {f"layer {layer}": [ratios[s].get(layer) for s in steps] for layer in layers}
    else:
        lines = {"worst layer": [max(ratios[s].values(), default=1.0) for s in steps]}
    fig = go.Figure()
    for i, (name, ys) in enumerate(lines.items()):
        fig.add_trace(go.Scatter(x=steps, y=ys, mode="lines+markers", name=name, line=dict(color=rank_color(i)),
                                 hovertemplate=f"{name}, step %{{x}}: %{{y:.2f}}<extra></extra>"))
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888")
    worst = max(max(v.values(), default=1.0) for v in ratios.values())
    styled(fig, title_lines(title, f"(worst {worst:.2f})"), xt, yt)
    fig.update_yaxes(rangemode="tozero")
    return fig

