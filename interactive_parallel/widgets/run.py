"""The panel's Run section: train with progress and a Stop button, generate, verify, checkpoints.

Owns the controls that call `session.train_async(on_step=...)` (as a Job, so the kernel keeps
serving cells and the Stop button, which calls `session.interrupt()`), `session.generate`,
`session.verify`, `session.save` / `session.load`, `session.export_script` and `session.run`,
and the text each result is shown as. Knows nothing of how ranks train or generate; a method
this version of Session lacks is reported in the panel, never stubbed here.
"""
from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any, Callable

import ipywidgets as W

from ._common import Job, button, css, describe_error, pre, session_method

if TYPE_CHECKING:
    from .panel import Panel


def _mean_loss(records: list[Any]) -> float | None:
    losses = [float(r.loss) for r in records if r.loss is not None and not math.isnan(float(r.loss))]
    return sum(losses) / len(losses) if losses else None


def verify_html(result: dict) -> str:
    ok = bool(result.get("ok"))
    head = (f"<b style='color:{'#1b7e1b' if ok else '#b00020'}'>{'ok' if ok else 'MISMATCH'}</b>: "
            f"loss differs from the single-process reference by {result.get('dloss')}")
    rows = "".join(f"<tr><td>{html.escape(str(p.get('name')))}</td><td>{p.get('max_abs_diff')}</td></tr>"
                   for p in result.get("params", []))
    table = f"<table><tr><th align='left'>parameter</th><th align='left'>max |diff|</th></tr>{rows}</table>"
    return head + (table if rows else "")


class RunSection:
    """Train N steps (progress, Stop), Generate, Verify, Save / Load, Export script."""

    def __init__(self, panel: "Panel"):
        self.panel = panel
        self.job: Job | None = None
        self.steps = css(W.IntText(value=10, description="steps", layout=W.Layout(width="140px")), "ip-train-steps")
        self.train = button("Train", "ip-train-button", style="primary", tooltip="session.train(steps)")
        self.interrupt = button("Stop", "ip-interrupt-button", style="warning",
                                tooltip="session.interrupt(): stop at the next step boundary")
        self.progress = css(W.IntProgress(value=0, min=0, max=1, description="progress"), "ip-train-progress")
        self.train_status = css(W.HTML(), "ip-train-status")
        self.prompts = css(W.Textarea(value="Once upon a time", placeholder="one prompt per line",
                                      layout=W.Layout(width="360px", height="60px")), "ip-prompts")
        self.max_tokens = css(W.IntText(value=16, description="max tokens", style={"description_width": "initial"},
                                        layout=W.Layout(width="140px")), "ip-max-tokens")
        self.do_sample = css(W.Checkbox(value=False, description="sample", indent=False,
                                        layout=W.Layout(width="90px")), "ip-do-sample")
        self.generate = button("Generate", "ip-generate-button", tooltip="session.generate(prompts)")
        self.generate_out = css(W.HTML(), "ip-generate-output")
        self.verify = button("Verify", "ip-verify-button", tooltip="session.verify(): parity with one process")
        self.verify_out = css(W.HTML(), "ip-verify-output")
        self.ckpt_path = css(W.Text(value="ckpt", description="checkpoint", layout=W.Layout(width="260px")),
                             "ip-checkpoint-path")
        self.save = button("Save", "ip-save-button", tooltip="session.save(path)")
        self.load = button("Load", "ip-load-checkpoint-button", tooltip="session.load(path)")
        self.export_path = css(W.Text(value="train_script.py", description="script", layout=W.Layout(width="260px")),
                               "ip-export-path")
        self.export = button("Export script", "ip-export-button", tooltip="session.export_script(path)")
        self.files_out = css(W.HTML(), "ip-files-output")
        self.run_out = css(W.HTML(), "ip-run-output")
        actions = panel.actions
        actions.register(self.train, self.interrupt, self.steps, self.prompts, self.max_tokens, self.do_sample)
        self.train.on_click(lambda _b: self.start_training())
        self.interrupt.on_click(lambda _b: self.stop_training())
        actions.on_click(self.generate, "generate", self._generate)
        actions.on_click(self.verify, "verify", self._verify)
        actions.on_click(self.save, "save", self._save)
        actions.on_click(self.load, "load", self._load)
        actions.on_click(self.export, "export_script", self._export)
        self.widget = css(W.VBox([
            W.HTML("<b>Run</b>"),
            W.HBox([self.steps, self.train, self.interrupt, self.progress, self.train_status]),
            W.HBox([self.prompts, W.VBox([W.HBox([self.max_tokens, self.do_sample]), self.generate])]),
            self.generate_out,
            W.HBox([self.verify, self.verify_out]),
            W.HBox([self.ckpt_path, self.save, self.load, self.export_path, self.export]),
            self.files_out, self.run_out,
        ]), "ip-section", "ip-section-run")

    # ---- training as a job -----------------------------------------------------------------------
    @property
    def training(self) -> bool:
        return self.job is not None and not self.job.done

    def start_training(self) -> Job | None:
        """Start `session.train_async(steps, on_step=...)` without blocking; None if it cannot start."""
        actions = self.panel.actions
        actions.clear()
        try:
            session = self.panel.require()
            train_async = session_method(session, "train_async")
            steps = self.steps.value
            coro = train_async(steps, on_step=self._on_step, **self.panel.plan_section.knobs())
        except Exception as exc:  # noqa: BLE001 - shown in the panel
            actions.show(describe_error(exc, "train"))
            return None
        self.progress.max, self.progress.value, self.progress.bar_style = max(steps, 1), 0, ""
        self.train_status.value = f"training {steps} steps ..."
        self.panel.begin("training", keep=[self.interrupt])
        self.job = Job(coro, self._train_done)
        return self.job

    def stop_training(self) -> None:
        if self.panel.session is not None:
            self.panel.session.interrupt()
        self.train_status.value = "stopping at the next step boundary ..."

    def _on_step(self, records: list[Any]) -> None:
        self.progress.value = min(self.progress.value + 1, self.progress.max)
        loss = _mean_loss(records)
        step = max((r.step for r in records), default="?")
        self.train_status.value = f"step {step}" + (f", mean loss {loss:.4f}" if loss is not None else "")
        self.panel.notify("step")

    def _train_done(self, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.progress.bar_style = "danger"
            self.panel.actions.show(describe_error(error, "train"))
            self.train_status.value = "failed (see above)"
        else:
            n = len({r.step for r in result or ()})
            self.progress.bar_style = "success"
            self.train_status.value = f"done: {n} steps" + (f"; last {self.train_status.value}" if n else "")
        self.panel.end()
        self.panel.notify("trained")

    # ---- blocking actions ------------------------------------------------------------------------
    def _generate(self) -> None:
        prompts = [line for line in self.prompts.value.splitlines() if line.strip()]
        kwargs = {"do_sample": True} if self.do_sample.value else {}
        texts = self.panel.require().generate(prompts, self.max_tokens.value, **kwargs)
        self.generate_out.value = "".join(
            f"<div class='ip-generated'><b>{html.escape(p)}</b><span style='color:#1f4fa0'>{html.escape(t)}</span>"
            "</div>" for p, t in zip(prompts, texts))

    def _verify(self) -> None:
        self.verify_out.value = verify_html(session_method(self.panel.require(), "verify")())

    def _save(self) -> None:
        path = self.ckpt_path.value.strip()
        out = session_method(self.panel.require(), "save")(path)
        self.files_out.value = f"saved checkpoint to {html.escape(str(out or path))}"

    def _load(self) -> None:
        path = self.ckpt_path.value.strip()
        session_method(self.panel.require(), "load")(path)
        self.files_out.value = f"loaded checkpoint from {html.escape(path)}"
        self.panel.notify("model")

    def _export(self) -> None:
        out = session_method(self.panel.require(), "export_script")(self.export_path.value.strip())
        self.files_out.value = f"wrote script {html.escape(str(out))}"

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
        self.interrupt.disabled = not (alive and self.training)
