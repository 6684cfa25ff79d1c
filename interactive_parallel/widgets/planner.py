"""The panel's Plan section: the model, a picker for every Plan field, problems shown as you type.

Owns the pickers, made from `Plan`'s dataclass fields so that a field added to Plan appears here
without editing the panel: a field with choices (`plan.field_choices`: its Literal type) ->
Dropdown, bool -> Checkbox, int -> IntText, float -> FloatText, str -> Text, any other type ->
Text read as a Python literal; each picker's tooltip is the field's docstring (`plan.field_docs`).
The degrees (the mesh axes, and `ep`) sit in one row; `ep` only while the model has experts
(its config says so: no torch), else hidden and back at 1.
`device` belongs to the Cluster section (it is the session's, not the plan's, to change): the
ranks and device the plan must fit come from the getters it is given. Also owns the live list
of problems (`plan.validate`, plus the session's own `check_plan` when one runs), the predicted
memory per rank of the picked plan (`plan.estimate.predict_memory`: it needs no rank, so it
shows before anything starts), and the Load and Apply buttons (`session.load_model`,
`session.apply`: what the ranks hold changed, an event the panel routes). Knows nothing of how
a plan is laid out on ranks (every rule it shows comes from plan/), nor of the other sections.
"""
from __future__ import annotations

import ast
import dataclasses
import typing
from typing import Any, Callable

import ipywidgets as W

from ..cluster.offline import spec_of
from ..plan import PRESETS, MeshAxis, Plan, PlanError, resolve_model, validate
from ..plan.estimate import predict_memory
from ..plan.models import CONFIGS
from ..plan.plan import field_choices, field_docs
from ._common import Actions, SessionRef, button, css, row
from .dryview import DryView, ShownLayout
from .events import Emit, RanksChanged
from .render import esc, note, prediction_text, problems_html

CLUSTER_FIELDS = ("device",)
"""Plan fields the Cluster section owns (a session's device is fixed when it starts)."""
EXPERT_FIELDS = ("ep",)
"""Degrees beside the mesh axes, shown only for a model with experts (a mixture of experts)."""
PREDICTION_UNAVAILABLE = "prediction unavailable"
COMPILE_NOTE = ("compile: the first training step compiles the decoder blocks, about a minute on 2 cores "
                "(seconds once this session has compiled the same plan and sequence length); later steps "
                "are faster; generation and serving run the blocks eagerly")
"""What Plan(compile=True) costs, said when it is ticked (bench/bench_compile.py measures it)."""


def picker(name: str, kind: Any, value: Any, doc: str) -> W.ValueWidget:
    """The widget for one Plan field, CSS class `ip-<name>` (underscores as dashes)."""
    common = dict(description=name, tooltip=doc, style={"description_width": "initial"},
                  layout=W.Layout(width="auto"))
    choices = field_choices(name)
    if choices:
        widget = W.Dropdown(options=list(dict.fromkeys([*choices, value])), value=value, **common)
    elif kind is bool:
        widget = W.Checkbox(value=bool(value), indent=False, **common)
    elif kind is int:
        widget = W.IntText(value=value, **common)
    elif kind is float:
        widget = W.FloatText(value=value, **common)
    elif kind is str:
        widget = W.Text(value=value, **common)
    else:
        widget = W.Text(value=repr(value), **common)
    return css(widget, f"ip-{name.replace('_', '-')}")


def grid(widgets: list[W.Widget], columns: int) -> W.GridBox:
    return W.GridBox(widgets, layout=W.Layout(grid_template_columns=f"repeat({columns}, minmax(0, 1fr))",
                                              grid_gap="2px 8px", width="100%"))


class PlanSection:
    """Pickers for every Plan field, the live problems and prediction, Load and Apply."""

    def __init__(self, session: SessionRef, actions: Actions, world: Callable[[], int], device: Callable[[], str],
                 shown_layout: ShownLayout, emit: Emit):
        self.session, self.world_size, self.device, self.emit = session, world, device, emit
        s = session()
        start = (s.plan if session.alive and s.plan is not None else None) or Plan(dp=world())
        model = s.spec.name if session.alive and s.spec is not None else "tiny-llama"
        self.preset = css(W.Dropdown(options=[*PRESETS, *CONFIGS], value=model if model in PRESETS else "tiny-llama",
                                     description="model", layout=W.Layout(width="200px")), "ip-model-preset")
        self.path = css(W.Text(placeholder="or a local model directory", layout=W.Layout(width="200px")),
                        "ip-model-path")
        self.load = button("Load", "ip-load-model-button", tooltip="session.load_model(preset or directory)")
        hints = typing.get_type_hints(Plan)
        docs = field_docs(Plan)
        self.kinds = {f.name: hints.get(f.name) for f in dataclasses.fields(Plan) if f.name not in CLUSTER_FIELDS}
        self.fields: dict[str, W.ValueWidget] = {
            n: picker(n, kind, getattr(start, n), docs.get(n, "")) for n, kind in self.kinds.items()}
        axes = {a.value for a in MeshAxis}
        self.degrees = {n: w for n, w in self.fields.items() if n in axes or n in EXPERT_FIELDS}
        self.degree_grid = grid(list(self.degrees.values()), max(len(self.degrees), 1))
        self._fitting = False
        self.messages = css(W.HTML(), "ip-plan-messages")
        self.prediction = css(W.HTML(), "ip-memory-prediction")
        self.apply = button("Apply", "ip-apply-button", style="primary", tooltip="session.apply(plan)")
        self.predicted: list | None = None
        self.dry = DryView(session, actions, self.plan, self.model_choice, shown_layout, emit)
        self.pickers = [self.preset, self.path, *self.fields.values()]
        for w in self.pickers:
            w.observe(lambda _c: self.revalidate(), names="value")
        actions.on_click(self.load, "load_model", self._load)
        actions.on_click(self.apply, "apply", self._apply)
        others = [w for n, w in self.fields.items() if n not in self.degrees]
        self.widget = css(W.VBox([
            W.HTML("<b>Plan</b>"),
            row(self.preset, self.path, self.load),
            self.degree_grid,
            grid(others, 3),
            self.messages, self.prediction, self.apply, self.dry.widget,
        ]), "ip-section", "ip-section-plan")

    # ---- reading and writing the pickers ------------------------------------------------------
    def read(self) -> tuple[dict[str, Any], list[str]]:
        """The picked value of every field, and a problem for each that cannot be read."""
        values, problems = {}, []
        for name, w in self.fields.items():
            if isinstance(w, W.Text) and self.kinds[name] is not str:
                try:
                    values[name] = ast.literal_eval(w.value)
                except (ValueError, SyntaxError):
                    problems.append(f"{name}: cannot read {w.value!r}")
            else:
                values[name] = float(w.value) if self.kinds[name] is float else w.value
        return values, problems

    def plan(self) -> Plan:
        """The Plan the pickers describe, on the session's (or the Cluster section's) device."""
        values, problems = self.read()
        if problems:
            raise PlanError(problems)
        return Plan(**values, device=self.device())

    def show(self, plan: Plan) -> None:
        """Set the pickers to `plan` (the session's, when it has one)."""
        for name, w in self.fields.items():
            value = getattr(plan, name)
            w.value = repr(value) if isinstance(w, W.Text) and self.kinds[name] is not str else value

    def has_experts(self) -> bool:
        """Whether the model the plan is for has experts: the loaded one, else the picked one's config."""
        s = self.session()
        try:
            spec = s.spec if self.session.alive and s.spec is not None else resolve_model(self.model_choice())
        except Exception:  # noqa: BLE001 - an unreadable model is a problem revalidate shows
            return False
        return spec.num_experts > 0

    def fit_experts(self) -> None:
        """Show the expert degrees for a model with experts; hide them (back at 1) otherwise."""
        moe = self.has_experts()
        for name in EXPERT_FIELDS:
            w = self.degrees.get(name)
            if w is None:
                continue
            w.layout.display = None if moe else "none"
            if not moe and w.value != 1:
                self._fitting = True  # one revalidate (the caller's), not one per reset
                try:
                    w.value = 1
                finally:
                    self._fitting = False
        shown = sum(w.layout.display != "none" for w in self.degrees.values())
        self.degree_grid.layout.grid_template_columns = f"repeat({max(shown, 1)}, minmax(0, 1fr))"

    def model_choice(self) -> str:
        return self.path.value.strip() or self.preset.value

    def spec(self) -> tuple[Any, str]:
        """(spec to validate against, a note saying which). The loaded model wins over the pickers."""
        s = self.session()
        if self.session.alive and s.spec is not None:
            return s.spec, f"{s.spec.name} (loaded)"
        try:
            spec = spec_of(self.model_choice())  # facts derived here, in this kernel, when needed (torch loads once)
        except Exception as exc:  # noqa: BLE001 - shown as a problem, not raised
            return None, f"model: {exc}"
        return spec, f"{spec.name} (not loaded yet: click Load)"

    # ---- live validation -----------------------------------------------------------------------
    def problems(self) -> tuple[Plan | None, list[str], Any, str]:
        values, problems = self.read()
        spec, model_note = self.spec()
        if problems:
            return None, problems, spec, model_note
        plan = Plan(**values, device=self.device())
        problems = validate(plan, self.world(plan), spec)
        if self.session.alive and not self.dry.on:
            try:
                self.session().check_plan(plan)  # the session's own extra rules (its device)
            except PlanError as exc:
                problems += [p for p in exc.problems if p not in problems]
        if spec is None:
            problems.append(model_note)
        return plan, problems, spec, model_note

    def world(self, plan: Plan) -> int:
        """The ranks the plan must fit: the live ones, or in dry-run mode its own degrees' product."""
        return plan.world_size if self.dry.on else self.world_size()

    def revalidate(self) -> list[str]:
        if self._fitting:
            return []
        self.fit_experts()
        plan, problems, spec, model_note = self.problems()
        label = plan.describe() if plan is not None else "?"
        fits = f"lays out on {plan.world_size} virtual ranks (dry run)" if self.dry.on and plan is not None \
            else f"fits {self.world_size()} ranks"
        text = problems_html(label, problems, fits, model_note if spec is not None else "")
        if plan is not None and plan.compile:
            text += f"<div class='ip-compile-note'>{note(COMPILE_NOTE)}</div>"
        current = self.session().plan if self.session.alive else None
        if current is not None and current != plan:
            text += f"<div>{note(f'not applied yet: the ranks run {current.describe()}; click Apply')}</div>"
        elif current is not None:
            text += f"<div>{note('applied')}</div>"
        self.messages.value = text
        self._predict(plan, problems, spec)
        self.dry.draw(None if problems or spec is None else plan, self.predicted)
        return problems

    def _predict(self, plan: Plan | None, problems: list[str], spec: Any) -> None:
        self.predicted = None
        if problems or spec is None or plan is None:
            self.prediction.value = note(f"{PREDICTION_UNAVAILABLE}: fix the plan first")
            return
        try:
            self.predicted = predict_memory(spec, plan)
        except Exception as exc:  # noqa: BLE001 - a prediction must never break the panel
            self.prediction.value = note(f"{PREDICTION_UNAVAILABLE}: {type(exc).__name__}: {exc}")
            return
        self.prediction.value = esc(prediction_text(self.predicted))

    # ---- actions ---------------------------------------------------------------------------------
    def _load(self) -> None:
        self.session.require().load_model(self.model_choice())
        self.emit(RanksChanged())

    def _apply(self) -> None:
        self.session.require().apply(self.plan())
        self.emit(RanksChanged())

    def sync(self, alive: bool, busy: bool) -> None:
        self.load.disabled = not alive or busy
        self.apply.disabled = not alive or busy or self.dry.on  # a dry run's world is not the ranks'
        for w in self.pickers:
            w.disabled = busy
        self.dry.sync(alive, busy)
