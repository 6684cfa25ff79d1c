"""The panel's Plan section: the model, a picker for every Plan field, problems shown as you type.

Owns the pickers, made from `Plan`'s dataclass fields so that a field added to Plan appears here
without editing the panel: bool -> Checkbox, int -> IntText, float -> FloatText, str -> Dropdown
when plan/ names its choices (the module constant called after the field: precision ->
PRECISIONS, pp_schedule -> PP_SCHEDULES), any other type -> Text read as a Python literal; each
picker's tooltip is the field's docstring. `device` belongs to the Cluster section (it is the
session's, not the plan's, to change). Also owns the live list of problems (`plan.validate`, plus
the session's own `check_plan` when one runs), the predicted memory per rank of the picked plan
(`plan.estimate.predict_memory`: it needs no rank, so it shows before anything starts), and the
Load and Apply buttons (`session.load_model`, `session.apply`). Knows nothing of how a plan is
laid out on ranks: every rule it shows comes from plan/.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from typing import TYPE_CHECKING, Any, Callable

import ipywidgets as W

from ..plan import PRESETS, MeshAxis, Plan, PlanError, resolve_model, validate
from ..plan import plan as plan_module
from ..plan.estimate import predict_memory
from ..plan.models import CONFIGS
from ._common import button, css, row
from .dryview import DryView
from .render import esc, note, prediction_text, problems_html

if TYPE_CHECKING:
    from .panel import Panel

CLUSTER_FIELDS = ("device",)
"""Plan fields the Cluster section owns (a session's device is fixed when it starts)."""
PREDICTION_UNAVAILABLE = "prediction unavailable"


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal under the field, as Plan documents them),
    from the class and the dataclasses it extends."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, IndexError, AttributeError):
            continue
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def choices_of(name: str) -> tuple | None:
    found = getattr(plan_module, f"{name.upper()}S", None)
    return tuple(found) if isinstance(found, (tuple, list)) else None


def picker(name: str, kind: Any, value: Any, doc: str) -> W.ValueWidget:
    """The widget for one Plan field, CSS class `ip-<name>` (underscores as dashes)."""
    common = dict(description=name, tooltip=doc, style={"description_width": "initial"},
                  layout=W.Layout(width="auto"))
    choices = choices_of(name) if kind is str else None
    if kind is bool:
        widget = W.Checkbox(value=bool(value), indent=False, **common)
    elif kind is int:
        widget = W.IntText(value=value, **common)
    elif kind is float:
        widget = W.FloatText(value=value, **common)
    elif choices:
        widget = W.Dropdown(options=list(dict.fromkeys([*choices, value])), value=value, **common)
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

    def __init__(self, panel: "Panel"):
        self.panel = panel
        s = panel.session
        start = (s.plan if panel.alive and s.plan is not None else None) or Plan(dp=panel.world_size)
        model = s.spec.name if panel.alive and s.spec is not None else "tiny-llama"
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
        self.degrees = {n: w for n, w in self.fields.items() if n in axes}
        self.messages = css(W.HTML(), "ip-plan-messages")
        self.prediction = css(W.HTML(), "ip-memory-prediction")
        self.apply = button("Apply", "ip-apply-button", style="primary", tooltip="session.apply(plan)")
        self.predicted: list | None = None
        self.dry = DryView(panel, self)
        self.pickers = [self.preset, self.path, *self.fields.values()]
        for w in self.pickers:
            w.observe(lambda _c: self.revalidate(), names="value")
        panel.actions.on_click(self.load, "load_model", self._load)
        panel.actions.on_click(self.apply, "apply", self._apply)
        others = [w for n, w in self.fields.items() if n not in self.degrees]
        self.widget = css(W.VBox([
            W.HTML("<b>Plan</b>"),
            row(self.preset, self.path, self.load),
            grid(list(self.degrees.values()), max(len(self.degrees), 1)),
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
        return Plan(**values, device=self.panel.device)

    def show(self, plan: Plan) -> None:
        """Set the pickers to `plan` (the session's, when it has one)."""
        for name, w in self.fields.items():
            value = getattr(plan, name)
            w.value = repr(value) if isinstance(w, W.Text) and self.kinds[name] is not str else value

    def knobs(self, train: Callable) -> dict[str, Any]:
        """The picked training knobs that `train` takes as keyword overrides (those that are Plan fields)."""
        plan = self.plan()
        return {n: getattr(plan, n) for n in inspect.signature(train).parameters if n in self.fields}

    def model_choice(self) -> str:
        return self.path.value.strip() or self.preset.value

    def spec(self) -> tuple[Any, str]:
        """(spec to validate against, a note saying which). The loaded model wins over the pickers."""
        s = self.panel.session
        if self.panel.alive and s.spec is not None:
            return s.spec, f"{s.spec.name} (loaded)"
        try:
            spec = resolve_model(self.model_choice())
        except Exception as exc:  # noqa: BLE001 - shown as a problem, not raised
            return None, f"model: {exc}"
        return spec, f"{spec.name} (not loaded yet: click Load)"

    # ---- live validation -----------------------------------------------------------------------
    def problems(self) -> tuple[Plan | None, list[str], Any, str]:
        values, problems = self.read()
        spec, model_note = self.spec()
        if problems:
            return None, problems, spec, model_note
        plan = Plan(**values, device=self.panel.device)
        problems = validate(plan, self.world(plan), spec)
        if self.panel.alive and not self.dry.on:
            try:
                self.panel.session.check_plan(plan)  # the session's own extra rules (its device)
            except PlanError as exc:
                problems += [p for p in exc.problems if p not in problems]
        if spec is None:
            problems.append(model_note)
        return plan, problems, spec, model_note

    def world(self, plan: Plan) -> int:
        """The ranks the plan must fit: the live ones, or in dry-run mode its own degrees' product."""
        return plan.world_size if self.dry.on else self.panel.world_size

    def revalidate(self) -> list[str]:
        plan, problems, spec, model_note = self.problems()
        label = plan.describe() if plan is not None else "?"
        fits = f"lays out on {plan.world_size} virtual ranks (dry run)" if self.dry.on and plan is not None \
            else f"fits {self.panel.world_size} ranks"
        text = problems_html(label, problems, fits, model_note if spec is not None else "")
        current = self.panel.session.plan if self.panel.alive else None
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
        self.panel.require().load_model(self.model_choice())
        self.panel.notify("model")

    def _apply(self) -> None:
        self.panel.require().apply(self.plan())
        self.panel.notify("plan")

    def sync(self, alive: bool, busy: bool) -> None:
        self.load.disabled = not alive or busy
        self.apply.disabled = not alive or busy or self.dry.on  # a dry run's world is not the ranks'
        for w in self.pickers:
            w.disabled = busy
        self.dry.sync(alive, busy)
