"""The panel's Serve section: continuous batching of generated requests, and quantization.

Owns the controls of a serving run: how many requests, one every how many seconds, how many
tokens at most, how many at once, which engine and policy; the requests come from
plan/inference.staggered_requests over the shared prompts and sampling controls it is given
(`do_sample`, temperature, top-k), so a script makes the same ones. Serve calls
`session.serve_async(on_token=..., on_request=...)` as the panel's Job through the job runner
it is given (Stop ends it) and shows each request's text growing as its tokens arrive;
Quantize and Full precision call `session.quantize(scheme)` and `session.dequantize()`. Knows
nothing of how ranks serve, of the other sections, nor of figures: the panel redraws the
Views when a job ends or the weights change.
"""
from __future__ import annotations

from typing import Any, Coroutine

import ipywidgets as W

from ..plan.inference import ENGINES, POLICIES, QUANT_SCHEMES, staggered_requests
from ..records import QuantizeRecord, RequestRecord, ServeResult, TokenRecord
from ._common import Actions, SessionRef, button, css, row
from .events import Emit, JobKind, RanksChanged
from .jobs import Job, JobRunner
from .render import esc, note, table
from .sampling import DEFAULT_PROMPT, Sampling, number

QUANTIZE_COLUMNS = ("rank", "linears", "params before", "after", "tok/s before", "after", "tokens unchanged")


def requests_html(rows: dict[str, dict]) -> str:
    """A line per request: id, state and its text so far."""
    lines = []
    for rid, r in rows.items():
        state = r["state"] if not r.get("reason") else f"done ({r['reason']})"
        lines.append(f"<div><b>{esc(rid)}</b> <span class='ip-note'>{esc(state)}</span> "
                     f"{esc(r['prompt'])}<span class='ip-completion'>{esc(r['text'])}</span></div>")
    return f"<div class='ip-scroll'>{''.join(lines)}</div>"


def quantization_html(records: list[QuantizeRecord]) -> str:
    if not records:
        return note("full precision")
    rows = [(r.rank, r.linears, f"{r.params_before / 2**20:.2f} MiB", f"{r.params_after / 2**20:.2f} MiB",
             f"{r.tokens_per_s_before:.0f}", f"{r.tokens_per_s_after:.0f}", f"{r.agreement:.0%}") for r in records]
    return f"<b>{esc(records[0].scheme)}</b> under {esc(records[0].plan)}" + table(QUANTIZE_COLUMNS, rows)


class ServeSection:
    """Serve generated requests (streamed, stoppable); quantize the model or return to full precision."""

    def __init__(self, session: SessionRef, actions: Actions, jobs: JobRunner, sampling: Sampling, emit: Emit):
        self.session, self.jobs, self.sampling, self.emit = session, jobs, sampling, emit
        self.count = number(W.IntText, 12, "requests", "ip-serve-count", "120px")
        self.gap = number(W.FloatText, 0.05, "every (s)", "ip-serve-gap", "130px")
        self.max_tokens = number(W.IntText, 16, "max tokens", "ip-serve-max-tokens", "130px")
        self.max_batch = number(W.IntText, 4, "at once", "ip-serve-max-batch", "110px")
        self.engine = css(W.Dropdown(options=ENGINES, value="auto", description="engine",
                                     layout=W.Layout(width="180px")), "ip-serve-engine")
        self.policy = css(W.Dropdown(options=POLICIES, value="continuous", description="policy",
                                     layout=W.Layout(width="180px")), "ip-serve-policy")
        self.serve = button("Serve", "ip-serve-button", tooltip="session.serve(requests, on_token=...)")
        self.serve_out = css(W.HTML(), "ip-serve-output")
        self.scheme = css(W.Dropdown(options=list(QUANT_SCHEMES), description="scheme",
                                     layout=W.Layout(width="230px")), "ip-quantize-scheme")
        self.quantize = button("Quantize", "ip-quantize-button", tooltip="session.quantize(scheme)")
        self.dequantize = button("Full precision", "ip-dequantize-button", tooltip="session.dequantize()")
        self.quantize_out = css(W.HTML(), "ip-quantize-output")
        self._rows: dict[str, dict] = {}
        self._ids: list[str] = []
        actions.register(self.serve, self.count, self.gap, self.max_tokens, self.max_batch, self.engine,
                         self.policy, self.scheme)
        self.serve.on_click(lambda _b: self.start_serving())
        actions.on_click(self.quantize, "quantize", self._quantize)
        actions.on_click(self.dequantize, "dequantize", self._dequantize)
        self.widget = css(W.VBox([
            W.HTML("<b>Serve</b> <span class='ip-note'>(prompts and sampling as for Generate)</span>"),
            row(self.count, self.gap, self.max_tokens, self.max_batch),
            row(self.engine, self.policy, self.serve),
            self.serve_out,
            row(self.scheme, self.quantize, self.dequantize),
            self.quantize_out,
        ]), "ip-section", "ip-section-serve")

    def requests(self) -> list:
        """The requests the controls describe (plan/inference.staggered_requests)."""
        prompts = self.sampling.lines() or [DEFAULT_PROMPT]
        return staggered_requests(self.count.value, float(self.gap.value), self.max_tokens.value, prompts,
                                  **self.sampling.request_options())

    def start_serving(self) -> Job | None:
        """`session.serve_async(requests, ..., on_token=..., on_request=...)` as the panel's Job."""
        reqs = self.requests()
        self._ids = [r.id for r in reqs]
        self._rows = {r.id: {"prompt": r.prompt, "text": "", "state": f"arrives at {r.arrival:g} s", "reason": ""}
                      for r in reqs}
        self.serve_out.value = requests_html(self._rows)

        def make(session: Any) -> Coroutine:
            return session.serve_async(reqs, engine=self.engine.value, policy=self.policy.value,
                                       max_batch=self.max_batch.value, on_token=self._on_token,
                                       on_request=self._on_request)

        total = sum(r.max_new_tokens for r in reqs)
        return self.jobs.start(JobKind.SERVE, make, total, self._served, f"serving {len(reqs)} requests ...")

    def _on_token(self, record: TokenRecord) -> None:
        if not 0 <= record.prompt < len(self._ids):
            return
        r = self._rows[self._ids[record.prompt]]
        r["text"] += record.text
        r["state"] = "decoding"
        self.jobs.advance()
        self.serve_out.value = requests_html(self._rows)

    def _on_request(self, record: RequestRecord) -> None:
        if record.id in self._rows:
            self._rows[record.id].update(text=record.text, reason=record.finish_reason)
            self.serve_out.value = requests_html(self._rows)

    def _served(self, result: ServeResult) -> None:
        for rec in result.requests:
            self._rows[rec.id].update(text=rec.text, reason=rec.finish_reason)
        self.serve_out.value = requests_html(self._rows)
        self.jobs.say(esc(
            f"served {len(result.requests)} requests with {result.engine} ({result.policy}): {result.tokens} tokens, "
            f"{result.tokens_per_s:.0f} tokens/s, {result.n_steps} steps, mean time to first token "
            f"{result.mean_ttft * 1e3:.0f} ms"))

    def _quantize(self) -> None:
        self.quantize_out.value = quantization_html(list(self.session.require().quantize(self.scheme.value)))
        self.emit(RanksChanged())

    def _dequantize(self) -> None:
        self.session.require().dequantize()
        self.quantize_out.value = quantization_html([])
        self.emit(RanksChanged())

    def sync(self, alive: bool, busy: bool) -> None:
        for w in (self.serve, self.count, self.gap, self.max_tokens, self.max_batch, self.engine, self.policy,
                  self.scheme, self.quantize, self.dequantize):
            w.disabled = not alive or busy
