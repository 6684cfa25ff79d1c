"""One standalone HTML file from a set of figures, and every figure a pile of records allows.

Owns the report's layout (a heading and a `<section id=KEY>` per figure, plotly.js embedded once)
and which figures `figures_from_records` builds. Knows nothing of where the records came from
(a Session, a saved JSON file) nor of torch, ipyparallel or widgets. Needs no network to view.
"""
from __future__ import annotations

import datetime as _dt
import html
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import plotly.graph_objects as go

from ..records import (CommRecord, DecodeStep, ExpertRecord, MemoryRecord, PipelineEvent, QuantizeRecord, Record,
                       ServeResult, ShardRecord, StepRecord)
from .comm_tree import comm_tree_figure
from .comms import comm_breakdown_figure, comm_matrix_figure
from .decoding import kv_memory_figure, quantization_figure, step_split_figure, tokens_per_step_figure
from .experts import expert_load_figure, expert_load_over_steps_figure, tokens_moved_figure
from .memory import memory_figure
from .pipeline import pipeline_figure
from .serving import latency_figure, request_timeline_figure
from .sharding import sharding_figure
from .timeline import is_timed, timeline_figure
from .training import loss_figure, throughput_figure

MAX_SHARDING_FIGURES = 6

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1100px;
       color: #222; padding: 0 1rem; }
h1 { margin-bottom: 0.2rem; } .generated { color: #777; margin-top: 0; }
section { margin: 2rem 0; border-top: 1px solid #ddd; padding-top: 0.5rem; }
"""


def _heading(key: str, fig: go.Figure) -> str:
    text = fig.layout.title.text if fig.layout.title and fig.layout.title.text else key
    return " ".join(re.sub(r"<[^>]+>", " ", str(text)).split())  # a title's line breaks read as spaces


def write_report(path: str | os.PathLike[str], figures: Mapping[str, go.Figure],
                 title: str = "interactive_parallel report", summary_html: str = "") -> Path:
    """Write one self-contained HTML file: a title, a generated-at line, `summary_html` (trusted HTML,
    inserted as is), then per figure a `<section id="KEY">` with a heading and the figure.

    plotly.js is embedded once, in the first figure; the file opens offline. Returns the path.
    """
    path = Path(path)
    stamp = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>", f"<style>{_STYLE}</style>", "</head>", "<body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="generated">Generated at {html.escape(stamp)} by interactive_parallel.</p>',
        summary_html,
    ]
    if not figures:
        parts.append("<p>No figures: no records yet.</p>")
    for i, (key, fig) in enumerate(figures.items()):
        div = fig.to_html(full_html=False, include_plotlyjs=(i == 0), default_width="100%",
                          config={"responsive": True, "displaylogo": False})
        parts += [f'<section id="{html.escape(str(key), quote=True)}">',
                  f"<h2>{html.escape(_heading(str(key), fig))}</h2>", div, "</section>"]
    parts += ["</body>", "</html>", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _section_key(param: str) -> str:
    return "sharding-" + re.sub(r"[^A-Za-z0-9_-]+", "-", param).strip("-")


def _sharding_params(shards: list[ShardRecord]) -> list[str]:
    """One param per distinct layout (placements and rank of the tensor), at most a handful."""
    seen: dict[tuple, str] = {}
    for r in sorted(shards, key=lambda r: (r.param, r.rank)):
        sig = (tuple(r.placements), len(r.global_shape))
        seen.setdefault(sig, r.param)
    return sorted(set(seen.values()))[:MAX_SHARDING_FIGURES]


def figures_from_records(records: Iterable[Record] | None) -> dict[str, go.Figure]:
    """Every figure the records have data for, keyed for `write_report`: loss, throughput, memory,
    comm_matrix, comm_breakdown, comm_tree (why each collective happened) and timeline (these two of
    the latest step), pipeline, sharding-<param> for one param of each distinct layout,
    expert_load, expert_imbalance and tokens_moved for a mixture of experts, and for inference:
    tokens_per_step, kv_memory, step_split (DecodeSteps), requests and latency (a ServeResult's
    requests), quantization. Records of other kinds (RankInfo) are ignored."""
    by_kind: dict[type, list[Record]] = {}
    for rec in records or ():
        if not isinstance(rec, Record):
            raise TypeError(f"expected records, got a {type(rec).__name__} (read dicts with records.from_dict)")
        by_kind.setdefault(type(rec), []).append(rec)
    steps, memory = by_kind.get(StepRecord, []), by_kind.get(MemoryRecord, [])
    comms, events = by_kind.get(CommRecord, []), by_kind.get(PipelineEvent, [])
    shards = by_kind.get(ShardRecord, [])
    figs: dict[str, go.Figure] = {}
    if steps:
        figs["loss"] = loss_figure(steps)
        figs["throughput"] = throughput_figure(steps)
    if memory:
        figs["memory"] = memory_figure(memory)
    if comms:
        figs["comm_matrix"] = comm_matrix_figure(comms)
        figs["comm_breakdown"] = comm_breakdown_figure(comms)
        latest = max(c.step for c in comms)  # why a step's collectives happened: one step's
        figs["comm_tree"] = comm_tree_figure([c for c in comms if c.step == latest])
    timed = [r.step for r in [*comms, *events] if is_timed(r)]
    if timed:  # the latest step only: a timeline of many steps is too dense to read
        figs["timeline"] = timeline_figure(comms, events, steps=max(timed))
    if events:
        figs["pipeline"] = pipeline_figure(events)
    for param in _sharding_params(shards):
        figs[_section_key(param)] = sharding_figure(shards, param)
    experts = by_kind.get(ExpertRecord, []) + [e for s in steps for e in s.experts]
    if experts:  # a mixture of experts: its routing per layer, and what moved between ep ranks
        figs["expert_load"] = expert_load_figure(experts)
        figs["expert_imbalance"] = expert_load_over_steps_figure(experts)
        if any(e.sent for e in experts):
            figs["tokens_moved"] = tokens_moved_figure(experts)
    decoding = by_kind.get(DecodeStep, [])
    if decoding:
        figs["tokens_per_step"] = tokens_per_step_figure(decoding)
        figs["kv_memory"] = kv_memory_figure(decoding)
        figs["step_split"] = step_split_figure(decoding)
    served = [r for result in by_kind.get(ServeResult, []) for r in result.requests]
    if served:
        figs["requests"] = request_timeline_figure(served)
        figs["latency"] = latency_figure(served)
    if by_kind.get(QuantizeRecord):
        figs["quantization"] = quantization_figure(by_kind[QuantizeRecord])
    return figs
