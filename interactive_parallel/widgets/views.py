"""The panel's views: a Tab of live figures (loss, memory, communication, sharding, pipeline).

Owns one FigureWidget per figure, built once and refreshed in place from the pure viz/
functions, and when each is refreshed: the loss on every step (from `session.history`, no
remote call), the others when their tab is opened, on Refresh, and after training, applying
or loading (from `session.memory()`, `comms()`, `layout()`, `timeline()`). Knows nothing of
how records are measured; a Session method this version lacks is named in the tab instead.
"""
from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any, Callable

import ipywidgets as W

from .. import viz
from ..cluster.errors import RankError
from ._common import MissingMethod, button, css, describe_error, figure_widget, refresh, session_method
from .planner import predict

if TYPE_CHECKING:
    from .panel import Panel

TABS = ("loss", "memory", "communication", "layout", "pipeline")


def kind_of(record: Any) -> str:
    return record.get("kind", "") if isinstance(record, dict) else getattr(record, "kind", "")


class ViewsSection:
    """The Tab of figures and the rules for when each is redrawn."""

    def __init__(self, panel: "Panel"):
        self.panel = panel
        self.loss = figure_widget(viz.loss_figure(None), "ip-loss-figure")
        self.memory = figure_widget(viz.memory_figure(None), "ip-memory-figure")
        self.comm_matrix = figure_widget(viz.comm_matrix_figure(None), "ip-comm-matrix-figure")
        self.comm_breakdown = figure_widget(viz.comm_breakdown_figure(None), "ip-comm-breakdown-figure")
        self.timeline = figure_widget(viz.timeline_figure(None), "ip-timeline-figure")
        self.sharding = figure_widget(viz.sharding_figure(None), "ip-sharding-figure", height=420)
        self.pipeline = figure_widget(viz.pipeline_figure(None), "ip-pipeline-figure")
        self.messages = {t: css(W.HTML(), f"ip-{t}-message") for t in TABS}
        self.param = css(W.Dropdown(options=[], description="parameter", layout=W.Layout(width="480px")),
                         "ip-layout-param")
        self.layout_table = css(W.HTML(), "ip-layout-table")
        self.refresh_button = button("Refresh", "ip-refresh-button", tooltip="redraw the open tab from the ranks")
        self._shards: list[Any] = []
        pages = {
            "loss": [self.loss],
            "memory": [self.memory],
            "communication": [W.HBox([self.comm_matrix, self.comm_breakdown]), self.timeline],
            "layout": [self.param, self.sharding, self.layout_table],
            "pipeline": [self.pipeline],
        }
        self.tab = css(W.Tab(children=[css(W.VBox([self.messages[t], *pages[t]]), f"ip-view-{t}") for t in TABS],
                             titles=list(TABS)), "ip-views")
        self.tab.observe(lambda _c: self.refresh_selected(), names="selected_index")
        self._quiet = False
        self.param.observe(lambda _c: self._quiet or self._draw_sharding(), names="value")
        self.refresh_button.on_click(lambda _b: self.refresh_selected())
        panel.actions.register(self.refresh_button)
        self.widget = css(W.VBox([W.HBox([W.HTML("<b>Views</b>"), self.refresh_button]), self.tab]),
                          "ip-section", "ip-section-views")
        self.refresh_loss()

    @property
    def selected(self) -> str:
        return TABS[self.tab.selected_index or 0]

    # ---- refresh rules -------------------------------------------------------------------------
    def refresh_loss(self) -> None:
        s = self.panel.session
        history = list(getattr(s, "history", None) or [])
        refresh(self.loss, viz.loss_figure(history))
        self.messages["loss"].value = "" if history else "<i>no steps yet: Train to see the loss per rank</i>"

    def refresh_selected(self) -> None:
        """Redraw the open tab from the ranks (not while training: the ranks are busy stepping)."""
        name = self.selected
        if name == "loss":
            self.refresh_loss()
            return
        if not self.panel.alive:
            self.messages[name].value = "<i>no session</i>"
            return
        if self.panel.run_section.training:
            self.messages[name].value = "<i>redrawn when training ends</i>"
            return
        self._guarded(name, getattr(self, f"_draw_{name}"))

    def _guarded(self, name: str, draw: Callable[[], str]) -> None:
        """Run a draw; its note, or why it could not draw, goes in the tab (the error area is left
        alone: it may hold a training failure the user has not read yet)."""
        try:
            self.messages[name].value = draw()
        except MissingMethod as exc:
            self.messages[name].value = f"<b>{html.escape(str(exc))}</b>"
        except Exception as exc:  # noqa: BLE001 - a view must never break the panel
            style = "color:#b00020" if isinstance(exc, RankError) else ""
            self.messages[name].value = (f"<pre style='{style};white-space:pre-wrap'>"
                                         f"{html.escape(describe_error(exc, name))}</pre>")

    def _call(self, name: str) -> list:
        return list(session_method(self.panel.session, name)() or [])

    # ---- one draw per tab ------------------------------------------------------------------------
    def _draw_memory(self) -> str:
        s = self.panel.session
        measured = self._call("memory")
        plan = getattr(s, "plan", None) or self.panel.plan_section.plan()
        spec = getattr(s, "spec", None)
        predicted, why = predict(spec, plan) if spec is not None else (None, "prediction unavailable: no model")
        refresh(self.memory, viz.memory_figure(measured, predicted))
        return f"<i>{html.escape(why)}</i>" if why else "measured (solid) beside predicted (hatched)"

    def _draw_communication(self) -> str:
        comms = self._call("comms")
        refresh(self.comm_matrix, viz.comm_matrix_figure(comms))
        refresh(self.comm_breakdown, viz.comm_breakdown_figure(comms))
        events = self._call("timeline")
        refresh(self.timeline, viz.timeline_figure([e for e in events if kind_of(e) == "comm"],
                                                   [e for e in events if kind_of(e) == "pipeline"]))
        return "" if comms else "<i>no communication recorded yet: Train a step</i>"

    def _draw_layout(self) -> str:
        self._shards = self._call("layout")
        names = sorted({r["param"] if isinstance(r, dict) else r.param for r in self._shards})
        keep = self.param.value if self.param.value in names else (names[0] if names else None)
        self._quiet = True  # one draw below, not one per intermediate dropdown value
        try:
            self.param.options = names
            self.param.value = keep
        finally:
            self._quiet = False
        self._draw_sharding()
        return "" if names else "<i>no layout yet: Load a model and Apply a plan</i>"

    def _draw_sharding(self) -> None:
        param = self.param.value
        refresh(self.sharding, viz.sharding_figure(self._shards, param))
        rows = [r for r in viz.layout_table(self._shards) if r["param"] == param] if self._shards else []
        cols = ("rank", "stage", "coords", "placements", "global_shape", "local_shape", "index")
        head = "".join(f"<th align='left' style='padding-right:1em'>{c}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in cols) + "</tr>" for r in rows)
        self.layout_table.value = f"<table><tr>{head}</tr>{body}</table>" if rows else ""

    def _draw_pipeline(self) -> str:
        events = [e for e in self._call("timeline") if kind_of(e) == "pipeline"]
        refresh(self.pipeline, viz.pipeline_figure(events))
        return "" if events else "<i>no pipeline events: Apply a plan with pp > 1 and Train</i>"

    def sync(self, alive: bool, busy: bool) -> None:
        self.refresh_button.disabled = busy
