"""HTML for what the panel shows as text: results of Session calls, and the panel's stylesheet.

Owns how a VerifyReport, doctor()'s RankInfo rows, stacks()'s StackRecords, a plan's problems, a memory prediction and
streamed completions read, and the CSS that gives them colour. Colours come from JupyterLab's
theme variables (`--jp-*`), never fixed light values, so the panel reads the same in the light
and the dark theme; in a dark theme the plotly figures (drawn by viz/ on a white template) are
inverted by a CSS filter that keeps their hues. Each Views tab is as wide as its label (the tab
bar scrolls when a column is too narrow for them all), so no label is cut. Pure functions of records and strings: knows
nothing of widgets, sessions or how the records were made.
"""
from __future__ import annotations

import html
from typing import Iterable, Sequence

from ..records import MemoryRecord, RankInfo, StackRecord, VerifyReport
from ..viz import human_bytes

STYLE = """<style>
.ip-panel { color: var(--jp-ui-font-color1); font-size: var(--jp-ui-font-size1); }
.ip-panel .widget-html-content { line-height: 1.4; }
.ip-panel .ip-section { border: 1px solid var(--jp-border-color2); border-radius: 4px; padding: 4px 8px;
  margin-bottom: 6px; background: var(--jp-layout-color1); }
.ip-panel .ip-ok { color: var(--jp-success-color1); }
.ip-panel .ip-bad { color: var(--jp-error-color1); }
.ip-panel .ip-note { color: var(--jp-ui-font-color2); font-style: italic; }
.ip-panel .ip-completion { color: var(--jp-brand-color1); }
.ip-panel table.ip-table { border-collapse: collapse; font-size: var(--jp-ui-font-size0); }
.ip-panel table.ip-table th { text-align: left; padding: 0 1em 0 0;
  border-bottom: 1px solid var(--jp-border-color2); }
.ip-panel table.ip-table td { padding: 0 1em 0 0; font-family: var(--jp-code-font-family); }
.ip-panel .ip-scroll { max-height: 220px; overflow: auto; }
.ip-panel .ip-section-views, .ip-panel .ip-figure { min-width: 0; overflow: hidden; }
.ip-panel .ip-views > .lm-TabBar { overflow-x: auto; overflow-y: hidden; }
.ip-panel .ip-views > .lm-TabBar .lm-TabBar-tab { flex: 0 0 auto; }
.ip-panel tr.ip-own td { background: var(--jp-info-color3); }
.ip-panel tr.ip-model td { background: var(--jp-warn-color3); }
.ip-panel pre { margin: 0; white-space: pre-wrap; color: var(--jp-ui-font-color1); }
body[data-jp-theme-light="false"] .ip-panel .ip-figure .main-svg { filter: invert(0.9) hue-rotate(180deg); }
</style>"""


def esc(value: object) -> str:
    return html.escape(str(value))


def pre(text: str) -> str:
    return f"<pre>{esc(text)}</pre>"


def note(text: str) -> str:
    return f"<span class='ip-note'>{esc(text)}</span>"


def table(head: Sequence[str], rows: Iterable[Sequence[object]], *, scroll: bool = False) -> str:
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    out = f"<table class='ip-table'><tr>{th}</tr>{body}</table>"
    return f"<div class='ip-scroll'>{out}</div>" if scroll else out


def verdict(ok: bool, yes: str = "OK", no: str = "MISMATCH") -> str:
    return f"<b class='{'ip-ok' if ok else 'ip-bad'}'>{esc(yes if ok else no)}</b>"


# ---- results of Session calls -------------------------------------------------------------------
def verify_html(report: VerifyReport) -> str:
    """OK / MISMATCH, the losses and their tolerance, and one row per parameter (worst marked)."""
    if report.note:
        return f"{verdict(False, no='NOT RUN')} {esc(report.plan)}: {esc(report.note)}"
    tol_loss, tol_grad = report.tolerance.get("loss", 0.0), report.tolerance.get("grad", 0.0)
    head = (f"{verdict(report.ok)} plan {esc(report.plan)}: loss {report.loss_par:.6f} against "
            f"{report.loss_ref:.6f} on one process, |dloss| {report.dloss:.2e} (tolerance {tol_loss:.0e}); "
            f"max |dgrad| {report.max_grad_diff:.2e} (tolerance {tol_grad:.0e})")
    rows = [(p.name, "x".join(map(str, p.shape)), f"{p.max_abs_diff:.2e}", "" if p.max_abs_diff <= tol_grad else "over")
            for p in report.params]
    return head + (table(("parameter", "shape", "max |dgrad|", ""), rows, scroll=True) if rows else "")


DOCTOR_COLUMNS = {"rank": "rank", "host": "host", "backend": "backend", "threads": "threads", "torch": "torch",
                  "barrier_ok": "barrier", "all_reduce_ok": "all_reduce", "bandwidth_gbps": "GB/s"}


def doctor_html(rows: Sequence[RankInfo]) -> str:
    """doctor()'s rows: one line per rank, failures named below the table."""
    def cell(r: RankInfo, c: str) -> object:
        v = getattr(r, c)
        if isinstance(v, bool):
            return "ok" if v else "FAILED"
        return f"{v:.2f}" if isinstance(v, float) else ("" if v is None else v)

    ok = all(r.barrier_ok and r.all_reduce_ok and not r.error for r in rows)
    errors = "".join(f"<div class='ip-bad'>rank {r.rank}: {pre(r.error)}</div>" for r in rows if r.error)
    rows_ = [[cell(r, c) for c in DOCTOR_COLUMNS] for r in rows]
    return (f"{verdict(ok, 'doctor: every rank met and added correctly', 'doctor: a check failed')}"
            f"{table(list(DOCTOR_COLUMNS.values()), rows_, scroll=True)}{errors}")


def completions_html(prompts: Sequence[str], texts: Sequence[str], done: Sequence[bool] | None = None) -> str:
    """Each prompt in bold, its completion so far after it (a caret while it is still growing)."""
    out = []
    for i, (p, t) in enumerate(zip(prompts, texts)):
        caret = "" if done is None or done[i] else "<span class='ip-note'>▌</span>"
        out.append(f"<div class='ip-generated'><b>{esc(p)}</b><span class='ip-completion'>{esc(t)}</span>{caret}</div>")
    return "".join(out)


def stacks_html(stacks: Sequence[StackRecord], frames: int = 12) -> str:
    """stacks(): per rank (and thread) its state and where it is, then a table of its innermost
    `frames` frames, innermost first: the package's own frames and the model's modules' marked
    (a colour each, and a column naming the module)."""
    out = []
    for s in stacks:
        who = f"rank {s.rank}" + (f" ({s.thread})" if s.thread and not s.main else "")
        if s.error:
            out.append(f"<div class='ip-bad'><b>{esc(who)}</b>: {esc(s.error)}</div>")
            continue
        out.append(f"<div><b>{esc(who)}</b>: {esc(s.state)}" + (f" at <code>{esc(s.where)}</code>" if s.where else "")
                   + "</div>")
        if not s.frames:
            continue
        rows = []
        for f in list(reversed(s.frames))[:frames]:
            cls = "ip-model" if f.module else "ip-own" if f.own else ""
            cells = (f"{f.file.rsplit('/', 1)[-1]}:{f.line}", f.function, f.module or ("package" if f.own else ""), f.code)
            rows.append(f"<tr class='{cls}'>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
        head = "".join(f"<th>{h}</th>" for h in ("file:line", "function", "module", "code"))
        more = len(s.frames) - frames
        tail = f"<div>{note(f'{more} outer frames not shown')}</div>" if more > 0 else ""
        out.append(f"<table class='ip-table ip-stack'><tr>{head}</tr>{''.join(rows)}</table>{tail}")
    return "<div class='ip-scroll'>" + "".join(out) + "</div>"


# ---- the plan -----------------------------------------------------------------------------------
def problems_html(label: str, problems: Sequence[str], fits: str, model: str) -> str:
    """Whether the picked plan can run (every problem when not), and which model it was checked against."""
    about = f"<div>{note(f'model {model}')}</div>" if model else ""
    if not problems:
        return f"<div class='ip-ok'>plan {esc(label)} {esc(fits)}</div>{about}"
    items = "".join(f"<li>{esc(p)}</li>" for p in problems)
    return f"<div class='ip-bad'>plan {esc(label)} cannot run:<ul>{items}</ul></div>{about}"


def rank_ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8, 9] -> '0-3, 8-9' (a 1,024-rank mesh reads in a line)."""
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def prediction_text(records: Sequence[MemoryRecord]) -> str:
    """One line per group of ranks with the same predicted bytes."""
    groups: dict[tuple, list[int]] = {}
    for r in records:
        groups.setdefault((r.params, r.grads, r.optimizer, r.activations), []).append(r.rank)
    lines = []
    for (p, g, o, a), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
        lines.append(f"{who}: {human_bytes(p + g + o + a)} (params {human_bytes(p)}, grads {human_bytes(g)}, "
                     f"optimizer {human_bytes(o)}, activations {human_bytes(a)})")
    return "predicted memory per rank: " + "; ".join(lines)
