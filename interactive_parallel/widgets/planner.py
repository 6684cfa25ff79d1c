"""The panel's Plan section: model choice, parallel degrees and training knobs, checked live.

Owns the pickers that make a `Plan`, the live list of problems (`plan.validate`, plus the
session's own `check_plan` when one is running) shown before anything runs, the predicted
memory per rank (from `plan.estimate.predict_memory` when that module exists), and the Load
and Apply buttons (`session.load_model`, `session.apply`). Knows nothing of how a plan is laid
out on ranks: every rule it shows comes from plan/, every action is a Session method.
"""
from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import ipywidgets as W

from ..plan import PP_SCHEDULES, PRECISIONS, PRESETS, Plan, PlanError, resolve_model, validate
from ..viz import human_bytes
from ._common import button, css

if TYPE_CHECKING:
    from .panel import Panel

DEGREES = ("dp", "fsdp", "tp", "pp", "cp")
KNOBS = ("batch_size", "seq_len", "grad_accum", "precision", "lr")
PREDICTION_UNAVAILABLE = "prediction unavailable"


def predict(spec: Any, plan: Plan) -> tuple[list[dict] | None, str]:
    """(per-rank predicted bytes, '') or (None, why not). The estimate module is optional: it may
    not exist in this version, so it is looked up at call time rather than at import."""
    try:
        from ..plan.estimate import predict_memory
    except ImportError:
        return None, f"{PREDICTION_UNAVAILABLE}: this version has no plan.estimate.predict_memory"
    try:
        # MemoryRecords (or their dicts): one row per rank
        return [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in predict_memory(spec, plan)], ""
    except Exception as exc:  # noqa: BLE001 - a prediction must never break the panel
        return None, f"{PREDICTION_UNAVAILABLE}: {type(exc).__name__}: {exc}"


def prediction_text(rows: list[dict]) -> str:
    """One line per group of ranks with the same prediction."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        parts = tuple(int(r.get(k) or 0) for k in ("params", "grads", "optimizer", "activations"))
        groups.setdefault(parts, []).append(int(r.get("rank", i)))
    lines = []
    for (p, g, o, a), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines.append(f"{who}: {human_bytes(p + g + o + a)} (params {human_bytes(p)}, grads {human_bytes(g)}, "
                     f"optimizer {human_bytes(o)}, activations {human_bytes(a)})")
    return "predicted memory per rank: " + "; ".join(lines)


def _int(name: str, value: int, width: str = "110px") -> W.IntText:
    return css(W.IntText(value=value, description=name, style={"description_width": "initial"},
                         layout=W.Layout(width=width)), f"ip-{name.replace('_', '-')}")


class PlanSection:
    """Pickers for every Plan field the panel exposes, the live problems, Load and Apply."""

    def __init__(self, panel: "Panel"):
        self.panel = panel
        s = panel.session
        start = (s.plan if s is not None and getattr(s, "plan", None) else None) or Plan(dp=panel.world_size)
        model = s.spec.name if s is not None and getattr(s, "spec", None) else "tiny-llama"
        self.preset = css(W.Dropdown(options=list(PRESETS), value=model if model in PRESETS else "tiny-llama",
                                     description="model"), "ip-model-preset")
        self.path = css(W.Text(placeholder="or a local model directory", layout=W.Layout(width="240px")),
                        "ip-model-path")
        self.load = button("Load", "ip-load-model-button", tooltip="session.load_model(preset or directory)")
        self.degrees = {n: _int(n, getattr(start, n), "90px") for n in DEGREES}
        self.schedule = css(W.Dropdown(options=list(PP_SCHEDULES), value=start.pp_schedule, description="schedule",
                                       layout=W.Layout(width="230px")), "ip-pp-schedule")
        self.microbatches = _int("microbatches", start.microbatches, "140px")
        self.batch_size = _int("batch_size", start.batch_size, "140px")
        self.seq_len = _int("seq_len", start.seq_len, "120px")
        self.grad_accum = _int("grad_accum", start.grad_accum, "140px")
        self.precision = css(W.Dropdown(options=list(PRECISIONS), value=start.precision, description="precision",
                                        layout=W.Layout(width="180px")), "ip-precision")
        self.lr = css(W.FloatText(value=start.lr, description="lr", style={"description_width": "initial"},
                                  layout=W.Layout(width="150px")), "ip-lr")
        self.messages = css(W.HTML(), "ip-plan-messages")
        self.prediction = css(W.HTML(), "ip-memory-prediction")
        self.apply = button("Apply", "ip-apply-button", style="primary", tooltip="session.apply(plan)")
        self.predicted: list[dict] | None = None
        self.pickers = [self.preset, self.path, *self.degrees.values(), self.schedule, self.microbatches,
                        self.batch_size, self.seq_len, self.grad_accum, self.precision, self.lr]
        for w in self.pickers:
            w.observe(lambda _c: self.revalidate(), names="value")
        panel.actions.on_click(self.load, "load_model", self._load)
        panel.actions.on_click(self.apply, "apply", self._apply)
        self.widget = css(W.VBox([
            W.HTML("<b>Plan</b>"),
            W.HBox([self.preset, self.path, self.load]),
            W.HBox([*self.degrees.values(), self.schedule, self.microbatches]),
            W.HBox([self.batch_size, self.seq_len, self.grad_accum, self.precision, self.lr]),
            self.messages, self.prediction, self.apply,
        ]), "ip-section", "ip-section-plan")

    # ---- reading the pickers -------------------------------------------------------------------
    def plan(self) -> Plan:
        """The Plan the pickers describe (fields the panel does not show kept from the session's)."""
        s = self.panel.session
        base = (s.plan if s is not None and getattr(s, "plan", None) else None) or Plan()
        values = {n: w.value for n, w in self.degrees.items()}
        values.update(pp_schedule=self.schedule.value, microbatches=self.microbatches.value,
                      batch_size=self.batch_size.value, seq_len=self.seq_len.value,
                      grad_accum=self.grad_accum.value, precision=self.precision.value, lr=float(self.lr.value),
                      device=self.panel.device)
        return base.replace(**values)

    def knobs(self) -> dict[str, Any]:
        """The training knobs as train() keyword overrides."""
        p = self.plan()
        return {k: getattr(p, k) for k in KNOBS}

    def model_choice(self) -> str:
        return self.path.value.strip() or self.preset.value

    def spec(self) -> tuple[Any, str]:
        """(spec to validate against, a note saying which). The loaded model wins over the pickers."""
        s = self.panel.session
        if self.panel.alive and getattr(s, "spec", None) is not None:
            return s.spec, f"{s.spec.name} (loaded)"
        try:
            spec = resolve_model(self.model_choice())
        except Exception as exc:  # noqa: BLE001 - shown as a problem, not raised
            return None, f"model: {exc}"
        return spec, f"{spec.name} (not loaded yet: click Load)"

    # ---- live validation -----------------------------------------------------------------------
    def problems(self) -> tuple[Plan, list[str], Any, str]:
        plan = self.plan()
        spec, note = self.spec()
        problems = validate(plan, self.panel.world_size, spec)
        s = self.panel.session
        if self.panel.alive and hasattr(s, "check_plan"):
            try:
                s.check_plan(plan)  # the session's own extra rules (its device)
            except PlanError as exc:
                problems += [p for p in exc.problems if p not in problems]
        if spec is None:
            problems.append(note)
        return plan, problems, spec, note

    def revalidate(self) -> list[str]:
        plan, problems, spec, note = self.problems()
        items = "".join(f"<li>{html.escape(p)}</li>" for p in problems)
        if problems:
            text = f"<div style='color:#b00020'>plan {html.escape(plan.describe())} cannot run:<ul>{items}</ul></div>"
        else:
            text = (f"<div style='color:#1b7e1b'>plan {html.escape(plan.describe())} fits "
                    f"{self.panel.world_size} ranks; model {html.escape(note)}</div>")
        s = self.panel.session
        current = getattr(s, "plan", None) if self.panel.alive else None
        if current is not None and current != plan:
            text += f"<div><i>not applied yet: the ranks run {html.escape(current.describe())}; click Apply</i></div>"
        elif current is not None:
            text += "<div><i>applied</i></div>"
        self.messages.value = text
        self._predict(plan, problems, spec)
        return problems

    def _predict(self, plan: Plan, problems: list[str], spec: Any) -> None:
        if problems or spec is None:
            self.prediction.value = f"<i>{PREDICTION_UNAVAILABLE}: fix the plan first</i>"
            self.predicted = None
            return
        rows, why = predict(spec, plan)
        self.predicted = rows
        self.prediction.value = f"<i>{html.escape(why)}</i>" if rows is None else html.escape(prediction_text(rows))

    # ---- actions ---------------------------------------------------------------------------------
    def _load(self) -> None:
        self.panel.require().load_model(self.model_choice())
        self.panel.notify("model")

    def _apply(self) -> None:
        self.panel.require().apply(self.plan())
        self.panel.notify("plan")

    def sync(self, alive: bool, busy: bool) -> None:
        self.load.disabled = self.apply.disabled = not alive or busy
        for w in self.pickers:
            w.disabled = busy
