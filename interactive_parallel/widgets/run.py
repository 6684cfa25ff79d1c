"""The panel's Run section: train and generate with progress and Stop, verify, checkpoints, export.

Owns the controls that call `session.train_async(on_step=...)` and
`session.generate_async(on_token=...)` (each as a Job, so the kernel keeps serving cells and the
Stop button, which calls `session.interrupt()`), `session.verify`, `session.save` /
`session.load`, `session.export_script` and `session.run`, and what their results show while
they stream and when they end. Knows nothing of how ranks train or generate, nor of figures:
each completed step is announced to the panel, which redraws what depends on it.
"""
from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any, Callable, Coroutine

import ipywidgets as W

from ..records import StepRecord, TokenRecord
from ._common import Job, button, css, describe_error, row
from .render import completions_html, pre, verify_html

if TYPE_CHECKING:
    from .panel import Panel


def mean_loss(records: list[StepRecord]) -> float | None:
    """Over the ranks that see the loss (pipeline ranks without the last stage report NaN)."""
    losses = [float(r.loss) for r in records if r.loss is not None and not math.isnan(float(r.loss))]
    return sum(losses) / len(losses) if losses else None


def _text(value: str, description: str, cls: str, width: str = "100%") -> W.Text:
    return css(W.Text(value=value, description=description, style={"description_width": "initial"},
                      layout=W.Layout(width=width)), cls)


def _number(widget: type, value: Any, description: str, cls: str, width: str) -> W.ValueWidget:
    return css(widget(value=value, description=description, style={"description_width": "initial"},
                      layout=W.Layout(width=width)), cls)


class RunSection:
    """Train N steps, Generate (streamed), Stop, Verify, Save / Load, Export script."""

    def __init__(self, panel: "Panel"):
        self.panel = panel
        self.job: Job | None = None
        self.steps = _number(W.IntText, 10, "steps", "ip-train-steps", "130px")
        self.train = button("Train", "ip-train-button", style="primary", tooltip="session.train(steps, on_step=...)")
        self.interrupt = button("Stop", "ip-interrupt-button", style="warning",
                                tooltip="session.interrupt(): stop training or generation at the next boundary")
        self.progress = css(W.IntProgress(value=0, min=0, max=1, layout=W.Layout(width="160px")), "ip-run-progress")
        self.status = css(W.HTML(), "ip-run-status")
        self.prompts = css(W.Textarea(value="12+35=", placeholder="one prompt per line",
                                      layout=W.Layout(width="100%", height="52px")), "ip-prompts")
        self.max_tokens = _number(W.IntText, 16, "max tokens", "ip-max-tokens", "130px")
        self.do_sample = css(W.Checkbox(value=False, description="sample", indent=False,
                                        layout=W.Layout(width="auto")), "ip-do-sample")
        self.temperature = _number(W.FloatText, 1.0, "temperature", "ip-temperature", "140px")
        self.top_k = _number(W.IntText, 0, "top-k", "ip-top-k", "100px")
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
        actions = panel.actions
        actions.register(self.train, self.generate, self.interrupt, self.steps, self.prompts, self.max_tokens,
                         self.do_sample, self.temperature, self.top_k)
        self.train.on_click(lambda _b: self.start_training())
        self.interrupt.on_click(lambda _b: self.stop())
        self.generate.on_click(lambda _b: self.start_generating())
        self.do_sample.observe(lambda _c: self.panel.sync(), names="value")
        actions.on_click(self.verify, "verify", self._verify)
        actions.on_click(self.save, "save", self._save)
        actions.on_click(self.load, "load", self._load)
        actions.on_click(self.export, "export_script", self._export)
        self.widget = css(W.VBox([
            W.HTML("<b>Run</b>"),
            row(self.steps, self.train, self.progress, self.interrupt),
            self.status,
            self.prompts,
            row(self.max_tokens, self.do_sample, self.temperature, self.top_k, self.generate),
            self.generate_out,
            row(self.verify), self.verify_out,
            row(self.ckpt_path, self.save, self.load),
            row(self.export_path, self.export),
            self.files_out, self.run_out,
        ]), "ip-section", "ip-section-run")

    # ---- long calls as jobs ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Training, generation or serving is under way (the ranks are busy; Stop is live)."""
        return self.job is not None and not self.job.done

    def start_job(self, what: str, activity: str, make: Callable[[Any], Coroutine], total: int,
               done: Callable[[Any], None], status: str) -> Job | None:
        """Start `make(session)` as a Job with every control but Stop off; None if it cannot start
        (the Serve section starts its serving runs here too, so Stop and the progress are shared)."""
        actions = self.panel.actions
        actions.clear()
        try:
            coro = make(self.panel.require())
        except Exception as exc:  # noqa: BLE001 - shown in the panel
            actions.show(describe_error(exc, what))
            return None
        self.progress.max, self.progress.value, self.progress.bar_style = max(total, 1), 0, ""
        self.status.value = status
        self.panel.begin(activity, keep=[self.interrupt])
        self.job = Job(coro, lambda result, error: self._finish(what, done, result, error))
        return self.job

    def _finish(self, what: str, done: Callable[[Any], None], result: Any, error: BaseException | None) -> None:
        try:
            if error is None:
                self.progress.bar_style = "success"
                done(result)
            else:
                self.progress.bar_style = "danger"
                self.panel.actions.show(describe_error(error, what))
                self.status.value = f"{what} failed (see above)"
        finally:
            self.panel.end()
            if what == "train":  # steps done before a failure or a Stop are kept: draw them too
                self.panel.notify("trained")

    def stop(self) -> None:
        if self.panel.alive:
            self.panel.session.interrupt()
        self.status.value = "stopping at the next boundary ..."

    # ---- training ----------------------------------------------------------------------------------
    def start_training(self) -> Job | None:
        """`session.train_async(steps, on_step=..., **picked training knobs)` without blocking."""
        self._requested = steps = self.steps.value

        def make(session: Any) -> Coroutine:
            return session.train_async(steps, on_step=self._on_step,
                                       **self.panel.plan_section.knobs(session.train_async))

        return self.start_job("train", "training", make, steps, self._trained, f"training {steps} steps ...")

    def _on_step(self, records: list[StepRecord]) -> None:
        self.progress.value = min(self.progress.value + 1, self.progress.max)
        loss = mean_loss(records)
        step = max((r.step for r in records), default="?")
        self.status.value = f"step {step}" + (f", mean loss {loss:.4f}" if loss is not None else "")
        self.panel.notify("step")

    def _trained(self, result: list[StepRecord]) -> None:
        n = len({r.step for r in result or ()})
        head = f"done: {n} steps" if n >= self._requested else f"stopped after {n} of {self._requested} steps"
        self.status.value = head + (f"; last {self.status.value}" if n else "")

    # ---- generation --------------------------------------------------------------------------------
    def start_generating(self) -> Job | None:
        """`session.generate_async(prompts, ..., on_token=...)`: completions grow as tokens arrive."""
        prompts = [line for line in self.prompts.value.splitlines() if line.strip()]
        n = self.max_tokens.value
        self._stream = {"prompts": prompts, "texts": [""] * len(prompts), "done": [False] * len(prompts)}

        def make(session: Any) -> Coroutine:
            return session.generate_async(prompts, n, do_sample=self.do_sample.value,
                                          temperature=float(self.temperature.value), top_k=self.top_k.value,
                                          on_token=self._on_token)

        self.generate_out.value = completions_html(prompts, self._stream["texts"], self._stream["done"])
        return self.start_job("generate", "generating", make, n, self._generated, f"generating up to {n} tokens ...")

    def _on_token(self, record: TokenRecord) -> None:
        s = self._stream
        if not 0 <= record.prompt < len(s["texts"]):
            return
        s["texts"][record.prompt] += record.text
        s["done"][record.prompt] = s["done"][record.prompt] or record.done
        self.progress.value = min(max(self.progress.value, record.position + 1), self.progress.max)
        self.generate_out.value = completions_html(s["prompts"], s["texts"], s["done"])

    def _generated(self, texts: list[str]) -> None:
        s = self._stream
        self.generate_out.value = completions_html(s["prompts"], texts)
        # decoding ends early only when every row has ended (end of sequence) or on Stop
        complete = self.progress.value >= self.progress.max or (bool(s["done"]) and all(s["done"]))
        self.status.value = "generated" if complete else f"stopped after {self.progress.value} tokens"

    # ---- blocking actions ------------------------------------------------------------------------
    def _verify(self) -> None:
        self.verify_out.value = verify_html(self.panel.require().verify())

    def _save(self) -> None:
        out = self.panel.require().save(self.ckpt_path.value.strip())
        self.files_out.value = f"saved checkpoint to {html.escape(out)}"

    def _load(self) -> None:
        out = self.panel.require().load(self.ckpt_path.value.strip())
        self.files_out.value = f"loaded checkpoint from {html.escape(out)}"
        self.panel.notify("model")

    def _export(self) -> None:
        out = self.panel.require().export_script(self.export_path.value.strip())
        self.files_out.value = f"wrote script {html.escape(out)}"

    def run_function(self, fn: Callable, *args: Any, **kwargs: Any) -> list | None:
        """session.run(fn, ...) through the panel: results per rank shown, a failure shown naming the rank."""
        def call() -> list:
            results = self.panel.require().run(fn, *args, **kwargs)
            self.run_out.value = pre("\n".join(f"rank {r}: {v!r}" for r, v in enumerate(results)))
            return results
        return self.panel.actions.run(getattr(fn, "__name__", "run"), call)

    def sync(self, alive: bool, busy: bool) -> None:
        for w in (self.train, self.generate, self.verify, self.save, self.load, self.export, self.steps,
                  self.prompts, self.max_tokens, self.do_sample):
            w.disabled = not alive or busy
        self.temperature.disabled = self.top_k.disabled = not alive or busy or not self.do_sample.value
        self.interrupt.disabled = not (alive and self.running)
