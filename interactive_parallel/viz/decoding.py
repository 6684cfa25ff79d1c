"""Decoding steps and quantization from DecodeStep and QuantizeRecord records.

Owns four views of a generate or serve call (tokens produced per step, KV-cache bytes per
rank, each step split into compute and communication per rank) and one of a quantization
(bytes and decoding speed before and after, per rank). The communication share of a step
is what the comm ledger measured on that rank (zero with the probes off); compute is the
rest. Knows nothing of how steps are run or measured, nor of torch, ipyparallel or widgets.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..records import DecodeStep, QuantizeRecord
from ._common import SUBPLOT_PX, MiB, empty_figure, human_bytes, rank_color, records_of, styled, title_lines

EMPTY = "no decoding yet: generate or serve"


def _steps(steps: Iterable[DecodeStep] | None) -> list[DecodeStep]:
    return sorted(records_of(steps, DecodeStep), key=lambda s: (s.rank, s.step))


def tokens_per_step_figure(steps: Iterable[DecodeStep] | Mapping[str, Iterable[DecodeStep]] | None,
                           title: str = "Tokens per decoding step") -> go.Figure:
    """Tokens produced at each step (bars) and the requests waiting (dotted lines): a trace per
    rank, or, given {label: steps} (e.g. a continuous and a static run), a trace per label drawn
    from its lowest rank. A continuous batch keeps the bars high, a static one lets them fall."""
    if isinstance(steps, Mapping):
        runs = {label: [s for s in _steps(recs) if s.rank == min(r.rank for r in _steps(recs))]
                for label, recs in steps.items()}
    else:
        recs = _steps(steps)
        runs = {f"rank {rank}": [s for s in recs if s.rank == rank] for rank in sorted({s.rank for s in recs})}
    runs = {label: mine for label, mine in runs.items() if mine}
    if not runs:
        return empty_figure(title, "step", "tokens", text=EMPTY)
    fig = go.Figure()
    for k, (label, mine) in enumerate(runs.items()):
        x = [s.step for s in mine]
        fig.add_trace(go.Bar(name=f"{label} tokens", x=x, y=[s.tokens for s in mine], marker_color=rank_color(k),
                             legendgroup=label, customdata=[s.phase for s in mine],
                             hovertemplate="step %{x}: %{y} tokens (%{customdata})<extra>" + label + "</extra>"))
        if any(s.waiting for s in mine):
            fig.add_trace(go.Scatter(name=f"{label} waiting", x=x, y=[s.waiting for s in mine], mode="lines",
                                     line=dict(color=rank_color(k), dash="dot"), legendgroup=label))
    return styled(fig, title, "step", "tokens", barmode="group")


def kv_memory_figure(steps: Iterable[DecodeStep] | None, title: str = "KV cache per rank") -> go.Figure:
    """Bytes of KV cache each rank held after each step (MiB), with the scheduler's budget dashed
    where it has one. Under TP a rank holds its heads, under PP its layers."""
    recs = _steps(steps)
    if not recs:
        return empty_figure(title, "step", "MiB", text=EMPTY)
    fig = go.Figure()
    for rank in sorted({s.rank for s in recs}):
        mine = [s for s in recs if s.rank == rank]
        fig.add_trace(go.Scatter(name=f"rank {rank}", x=[s.step for s in mine], y=[s.kv_bytes / MiB for s in mine],
                                 mode="lines+markers", line=dict(color=rank_color(rank)), legendgroup=f"r{rank}",
                                 text=[human_bytes(s.kv_bytes) for s in mine],
                                 hovertemplate="step %{x}: %{text}<extra>rank " + str(rank) + "</extra>"))
        budget = max((s.kv_budget for s in mine), default=0)
        if budget:
            fig.add_trace(go.Scatter(name=f"rank {rank} budget", x=[mine[0].step, mine[-1].step],
                                     y=[budget / MiB] * 2, mode="lines", legendgroup=f"r{rank}",
                                     line=dict(color=rank_color(rank), dash="dash")))
    return styled(fig, title, "step", "MiB")


def step_split_figure(steps: Iterable[DecodeStep] | None,
                      title: str = "Decoding steps: compute and communication") -> go.Figure:
    """A row per rank: each step's time (ms) stacked as compute and communication."""
    recs = _steps(steps)
    if not recs:
        return empty_figure(title, "step", "ms", text=EMPTY)
    ranks = sorted({s.rank for s in recs})
    fig = make_subplots(rows=len(ranks), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=[f"rank {r}" for r in ranks])
    for row, rank in enumerate(ranks, start=1):
        mine = [s for s in recs if s.rank == rank]
        x = [s.step for s in mine]
        for name, values, color in (("compute", [s.compute_s * 1e3 for s in mine], "#4c78a8"),
                                    ("communication", [s.comm_s * 1e3 for s in mine], "#e45756")):
            fig.add_trace(go.Bar(name=name, x=x, y=values, marker_color=color, legendgroup=name,
                                 showlegend=row == 1), row=row, col=1)
    styled(fig, title, "", "ms", above=SUBPLOT_PX, barmode="stack", height=max(300, 160 * len(ranks)))
    fig.update_xaxes(title_text="step", row=len(ranks), col=1)
    return fig


def quantization_figure(records: Iterable[QuantizeRecord] | None, title: str = "Quantization") -> go.Figure:
    """Per rank: parameter bytes before and after (the full-precision copy kept aside stacked
    on the after bar, hatched) and greedy decoding tokens/s before and after."""
    recs = sorted(records_of(records, QuantizeRecord), key=lambda r: r.rank)
    if not recs:
        return empty_figure(title, "rank", "MiB", text="not quantized: call quantize()")
    ranks = [f"rank {r.rank}" for r in recs]
    scheme = recs[0].scheme
    agree = sum(r.agreement for r in recs) / len(recs)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("parameter bytes (MiB)", "decoding tokens/s"))
    fig.add_trace(go.Bar(name="before", x=ranks, y=[r.params_before / MiB for r in recs], marker_color="#bab0ac",
                         offsetgroup="before", legendgroup="before"), row=1, col=1)
    fig.add_trace(go.Bar(name=f"after ({scheme})", x=ranks, y=[r.params_after / MiB for r in recs],
                         marker_color="#4c78a8", offsetgroup="after", legendgroup="after"), row=1, col=1)
    fig.add_trace(go.Bar(name="full precision kept aside", x=ranks, y=[r.kept_bytes / MiB for r in recs],
                         base=[r.params_after / MiB for r in recs], marker=dict(color="#4c78a8", opacity=0.3,
                                                                                pattern=dict(shape="/")),
                         offsetgroup="after"), row=1, col=1)
    fig.add_trace(go.Bar(name="before", x=ranks, y=[r.tokens_per_s_before for r in recs], marker_color="#bab0ac",
                         offsetgroup="before", legendgroup="before", showlegend=False), row=1, col=2)
    fig.add_trace(go.Bar(name=f"after ({scheme})", x=ranks, y=[r.tokens_per_s_after for r in recs],
                         marker_color="#4c78a8", offsetgroup="after", legendgroup="after", showlegend=False),
                  row=1, col=2)
    return styled(fig, title_lines(f"{title}: {scheme},", f"greedy tokens unchanged {agree:.0%}"), "", "",
                  above=SUBPLOT_PX, barmode="group")
