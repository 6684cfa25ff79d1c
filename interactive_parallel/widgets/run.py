"""The panel's Run section: train and generate with progress and Stop, verify, checkpoints, export.

Owns the controls that call `session.train_async(on_step=...)` and
`session.generate_async(on_token=...)` (each as the panel's Job through the job runner it is
given, so the kernel keeps serving cells and the Stop button), `session.verify`,
`session.save` / `session.load`, `session.export_script` and `session.run`, and what their
results show while they stream and when they end. It shows the runner's progress, status,
Stop and "Where are the ranks?", the path of the text to train on, and the shared prompts and
sampling controls beside Generate; the training knobs come from the plan getter it is given. Knows nothing of how
ranks train or generate, of the other sections, nor of figures: a completed step or a
loaded checkpoint is an event the panel routes.
"""
from __future__ import annotations

import dataclasses
import html
import inspect
import math
from typing import Any, Callable, Coroutine

import ipywidgets as W

from ..plan import Plan
from ..records import StepRecord, TokenRecord
from ._common import Actions, SessionRef, button, css, row
from .events import Emit, JobKind, RanksChanged, StepDone
from .jobs import Job, JobRunner
from .render import completions_html, pre, verify_html
from .sampling import Sampling, number

def mean_loss(records: list[StepRecord]) -> float | None:
    """Over the ranks that see the loss (pipeline ranks without the last stage report NaN)."""
    losses = [float(r.loss) for r in records if r.loss is not None and not math.isnan(float(r.loss))]
    return sum(losses) / len(losses) if losses else None


def knobs(plan: Plan, train: Callable) -> dict[str, Any]:
    """The fields of `plan` that `train` takes as keyword overrides (the training knobs)."""
    fields = {f.name for f in dataclasses.fields(plan)}
    return {n: getattr(plan, n) for n in inspect.signature(train).parameters if n in fields}


def _text(value: str, description: str, cls: str, width: str = "100%") -> W.Text:
    return css(W.Text(value=value, description=description, style={"description_width": "initial"},
                      layout=W.Layout(width=width)), cls)


class RunSection:
    """Train N steps, Generate (streamed), Stop, Verify, Save / Load, Export script."""

    def __init__(self, session: SessionRef, actions: Actions, jobs: JobRunner, sampling: Sampling,
                 plan: Callable[[], Plan], emit: Emit):
        self.session, self.actions, self.jobs, self.sampling = session, actions, jobs, sampling
        self.plan, self.emit = plan, emit
        self.progress, self.status, self.interrupt = jobs.progress, jobs.status, jobs.interrupt
        self.prompts, self.do_sample = sampling.prompts, sampling.do_sample
        self.temperature, self.top_k = sampling.temperature, sampling.top_k
        self.steps = number(W.IntText, 10, "steps", "ip-train-steps", "130px")
        self.data = _text("", "data", "ip-train-data", "260px")
        self.data.placeholder = "text, .jsonl or datasets dir (empty: as before)"
        self.train = button("Train", "ip-train-button", style="primary", tooltip="session.train(steps, on_step=...)")
        self.max_tokens = number(W.IntText, 16, "max tokens", "ip-max-tokens", "130px")
        self.generate = button("Generate", "ip-generate-button", tooltip="session.generate(prompts, on_token=...)")
        self.generate_out = css(W.HTML(), "ip-generate-output")
        self.verify = button("Verify", "ip-verify-button", tooltip="session.verify(): parity with one process")
        self.verify_out = css(W.HTML(), "ip-verify-output")
        self.ckpt_path = _text("ckpt", "checkpoint", "ip-checkpoint-path", "220px")
        self.save = button("Save", "ip-save-button", tooltip="session.save(path)")
        self.load = button("Load", "ip-load-checkpoint-button", tooltip="session.load(path)")
        self.export_path = _text("train_script.py", "script", "ip-export-path", "220px")
        self.export = button("Export script", "ip-export-button", tooltip="session.export_script(path)")
        self.files_out = css(W.HTML(), "ip-files-output")
        self.run_out = css(W.HTML(), "ip-run-output")
        self._requested = 0
        self._stream: dict[str, list] = {"prompts": [], "texts": [], "done": []}
        actions.register(self.train, self.generate, self.steps, self.data, self.max_tokens)
        self.train.on_click(lambda _b: self.start_training())
        self.generate.on_click(lambda _b: self.start_generating())
        actions.on_click(self.verify, "verify", self._verify)
        actions.on_click(self.save, "save", self._save)
        actions.on_click(self.load, "load", self._load)
        actions.on_click(self.export, "export_script", self._export)
        self.widget = css(W.VBox([
            W.HTML("<b>Run</b>"),
            row(self.steps, self.data, self.train, self.progress, self.interrupt, jobs.where),
            self.status, jobs.where_out, jobs.where_box,
            self.prompts,
            row(self.max_tokens, self.do_sample, self.temperature, self.top_k, self.generate),
            self.generate_out,
            row(self.verify), self.verify_out,
            row(self.ckpt_path, self.save, self.load),
            row(self.export_path, self.export),
            self.files_out, self.run_out,
        ]), "ip-section", "ip-section-run")

    # ---- training ----------------------------------------------------------------------------------
    def start_training(self) -> Job | None:
        """`session.train_async(steps, on_step=..., data=..., **picked training knobs)` without
        blocking; an empty data field passes none (the session keeps the text it has)."""
        self._requested = steps = self.steps.value
        data = {"data": self.data.value.strip()} if self.data.value.strip() else {}

        def make(session: Any) -> Coroutine:
            return session.train_async(steps, on_step=self._on_step, **data,
                                       **knobs(self.plan(), session.train_async))

        return self.jobs.start(JobKind.TRAIN, make, steps, self._trained, f"training {steps} steps ...")

    def _on_step(self, records: list[StepRecord]) -> None:
        self.jobs.advance()
        loss = mean_loss(records)
        step = max((r.step for r in records), default="?")
        self.jobs.say(f"step {step}" + (f", mean loss {loss:.4f}" if loss is not None else ""))
        self.emit(StepDone())

    def _trained(self, result: list[StepRecord]) -> None:
        n = len({r.step for r in result or ()})
        head = f"done: {n} steps" if n >= self._requested else f"stopped after {n} of {self._requested} steps"
        self.jobs.say(head + (f"; last {self.status.value}" if n else ""))

    # ---- generation --------------------------------------------------------------------------------
    def start_generating(self) -> Job | None:
        """`session.generate_async(prompts, ..., on_token=...)`: completions grow as tokens arrive."""
        prompts = self.sampling.lines()
        n = self.max_tokens.value
        self._stream = {"prompts": prompts, "texts": [""] * len(prompts), "done": [False] * len(prompts)}

        def make(session: Any) -> Coroutine:
            return session.generate_async(prompts, n, **self.sampling.generate_options(), on_token=self._on_token)

        self.generate_out.value = completions_html(prompts, self._stream["texts"], self._stream["done"])
        return self.jobs.start(JobKind.GENERATE, make, n, self._generated, f"generating up to {n} tokens ...")

    def _on_token(self, record: TokenRecord) -> None:
        s = self._stream
        if not 0 <= record.prompt < len(s["texts"]):
            return
        s["texts"][record.prompt] += record.text
        s["done"][record.prompt] = s["done"][record.prompt] or record.done
        self.jobs.advance(to=record.position + 1)
        self.generate_out.value = completions_html(s["prompts"], s["texts"], s["done"])

    def _generated(self, texts: list[str]) -> None:
        s = self._stream
        self.generate_out.value = completions_html(s["prompts"], texts)
        # decoding ends early only when every row has ended (end of sequence) or on Stop
        complete = self.jobs.complete or (bool(s["done"]) and all(s["done"]))
        self.jobs.say("generated" if complete else f"stopped after {self.progress.value} tokens")

    # ---- blocking actions ------------------------------------------------------------------------
    def _verify(self) -> None:
        self.verify_out.value = verify_html(self.session.require().verify())

    def _save(self) -> None:
        out = self.session.require().save(self.ckpt_path.value.strip())
        self.files_out.value = f"saved checkpoint to {html.escape(out)}"

    def _load(self) -> None:
        out = self.session.require().load(self.ckpt_path.value.strip())
        self.files_out.value = f"loaded checkpoint from {html.escape(out)}"
        self.emit(RanksChanged())

    def _export(self) -> None:
        out = self.session.require().export_script(self.export_path.value.strip())
        self.files_out.value = f"wrote script {html.escape(out)}"

    def run_function(self, fn: Callable, *args: Any, **kwargs: Any) -> list | None:
        """session.run(fn, ...) through the panel: results per rank shown, a failure shown naming the rank."""
        def call() -> list:
            results = self.session.require().run(fn, *args, **kwargs)
            self.run_out.value = pre("\n".join(f"rank {r}: {v!r}" for r, v in enumerate(results)))
            return results
        return self.actions.run(getattr(fn, "__name__", "run"), call)

    def sync(self, alive: bool, busy: bool) -> None:
        for w in (self.train, self.generate, self.verify, self.save, self.load, self.export, self.steps,
                  self.data, self.max_tokens):
            w.disabled = not alive or busy
