"""The panel's views: a Tab of live figures (loss, memory, communication, layout, pipeline,
decoding, requests, quantization, experts) and the "Which plan?" page (plans).

Owns one FigureWidget per figure, built once and refreshed in place from the pure viz/
functions, and when each is redrawn. Loss, memory, communication, pipeline and experts (a
mixture-of-experts model's routing) come from the telemetry the Session already holds
(`history`, `memory()`, `comms()`, `timeline()`, `experts()`: local reads, no remote call;
the communication tab draws the comm matrix, the bytes per axis and op, and why each collective
happened: viz.comm_tree_figure, the tree `explain_comms()` returns), so while the ranks train
the loss and the open tab are redrawn as steps arrive (at most every `live_interval` seconds; a
tab opened meanwhile is drawn at once).
The predicted memory beside the measured is `session.predict_memory()`, once per plan. The
layout is `session.layout()` (a remote call, cached by the Session per applied plan): read once
per plan, when its tab is open and the ranks are not busy; a click on a block of its map fetches
that rank's block (`session.fetch`, widgets/shardpeek.py), shown beside the map. Decoding (tokens per step, KV cache
per rank, compute and communication per step), requests (timeline, latency) and quantization
come from the latest generate / serve / quantize call the Session kept (`decoding()`,
`served()`, `quantized()`: local reads), redrawn when such a call ends. In the Plan section's
dry-run mode, with a dry run kept, memory, communication and layout draw the dry run's records
instead (widgets/dryview.py), labelled so, with or without a session. The plans page is the
page it is given (widgets/whichplan.py: its controls, table and figures), redrawn as the others
are: when opened, and as steps arrive while it is open. Whether the ranks are
busy and which dry run is kept come from getters it is given. Tab labels are short and each tab
as wide as its label, and no figure is laid out narrower than a title line fits
(viz.TITLE_FITS_PX), so labels and titles are never cut. Knows nothing of how records are
measured, nor of the controls or the other sections; fitting the figures to the column is
widgets/fit.py's.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import ipywidgets as W
import plotly.graph_objects as go

from .. import viz
from ..cluster.errors import RankError
from ..plan.activations import stream_bytes
from ..plan.estimate import predict_memory
from ..records import CommRecord, PipelineEvent
from ._common import Actions, SessionRef, button, css, describe_error, figure_widget, refresh, row
from .dryview import label, params_of, shown_ranks
from .render import note, pre, table
from .shardpeek import ShardPeek

TABS = ("loss", "memory", "communication", "layout", "pipeline", "decoding", "requests", "quantization", "experts",
        "plans")
"""Each tab's name (its page's and message's CSS classes: ip-view-<name>, ip-<name>-message)."""
TAB_TITLES = {"communication": "comms", "quantization": "quantized"}
"""Labels shorter than the name where the name is long; the others show their name."""
TAB_CHARS = 9
"""The longest label: labels this short side by side fit the views' column (the bar scrolls past it)."""
DRY_TABS = ("memory", "communication", "layout")
"""The tabs that draw a dry run's records in dry-run mode."""
LIVE_INTERVAL_S = 0.5
"""Least time between two live redraws during training: a tiny model's steps come faster than
that, and redrawing every figure at their rate would slow the client more than it shows."""
SIDE_BY_SIDE = f"repeat(auto-fit, minmax(min(100%, {viz.TITLE_FITS_PX}px), 1fr))"
"""Grid columns for figures side by side: two while each keeps the width a title line fits,
else one under the other."""
SHARD_COLUMNS = ("rank", "stage", "coords", "placements", "global_shape", "local_shape", "index")


def tab_title(name: str) -> str:
    return TAB_TITLES.get(name, name)


def dry_labelled(figure: go.Figure) -> go.Figure:
    """`figure` with '(dry run)' after its title (on a line of its own when the last is full)."""
    return viz.add_to_title(figure, "(dry run)")


def _empty_figures() -> dict[str, Any]:
    """CSS class -> an empty FigureWidget, one per figure the views draw, in the order
    ViewsSection names them."""
    return {cls: figure_widget(figure, cls, height) for cls, figure, height in (
        ("ip-loss-figure", viz.loss_figure(None), 360),
        ("ip-memory-figure", viz.memory_figure(None), 360),
        ("ip-comm-matrix-figure", viz.comm_matrix_figure(None), 320),
        ("ip-comm-breakdown-figure", viz.comm_breakdown_figure(None), 320),
        ("ip-comm-tree-figure", viz.comm_tree_figure(None), 420),
        ("ip-timeline-figure", viz.timeline_figure(None), 360),
        ("ip-sharding-figure", viz.sharding_figure(None), 420),
        ("ip-pipeline-figure", viz.pipeline_figure(None), 360),
        ("ip-tokens-per-step-figure", viz.tokens_per_step_figure(None), 300),
        ("ip-kv-memory-figure", viz.kv_memory_figure(None), 300),
        ("ip-step-split-figure", viz.step_split_figure(None), 360),
        ("ip-request-timeline-figure", viz.request_timeline_figure(None), 380),
        ("ip-latency-figure", viz.latency_figure(None), 300),
        ("ip-quantization-figure", viz.quantization_figure(None), 340),
        ("ip-expert-load-figure", viz.expert_load_figure(None), 320),
        ("ip-tokens-moved-figure", viz.tokens_moved_figure(None), 320))}


class ViewsSection:
    """The Tab of figures and the rules for when each is redrawn."""

    def __init__(self, session: SessionRef, actions: Actions, busy: Callable[[], bool], dry: Callable[[], Any],
                 plans: Any):
        """`plans`: the Which plan? page (widgets/whichplan.py's WhichPlanSection: `widget`, `figures`, `draw()`)."""
        self.session, self.busy, self._dry, self.plans = session, busy, dry, plans
        self._drawing = threading.RLock()
        """Held while a figure is redrawn: outside a kernel the job's steps arrive on its thread
        while a tab opens on this one, and two redraws of one figure at once would both add its traces."""
        self.live_interval = LIVE_INTERVAL_S
        self.figures = _empty_figures()
        """CSS class -> FigureWidget (the browser test finds them by it; widgets/fit.py sizes them by it)."""
        (self.loss, self.memory, self.comm_matrix, self.comm_breakdown, self.comm_tree, self.timeline, self.sharding,
         self.pipeline, self.tokens_per_step, self.kv_memory, self.step_split, self.request_timeline, self.latency,
         self.quantization, self.expert_load, self.tokens_moved) = self.figures.values()
        self.figures.update(plans.figures)
        self.messages = {t: css(W.HTML(), f"ip-{t}-message") for t in TABS}
        self.param = css(W.Dropdown(options=[], description="parameter", layout=W.Layout(width="100%")),
                         "ip-layout-param")
        self.layout_table = css(W.HTML(), "ip-layout-table")
        self.peek = ShardPeek(self.sharding, session, self.shown_layout, busy, self.dry)
        self.refresh_button = button("Refresh", "ip-refresh-button", tooltip="redraw the open tab from the session")
        self._shards: list[Any] = []
        self._layout_key: tuple | None = None
        self._predicted: tuple[tuple, list] | None = None
        self._last_live = 0.0
        pages = {
            "loss": [self.loss],
            "memory": [self.memory],
            "communication": [W.GridBox([self.comm_matrix, self.comm_breakdown], layout=W.Layout(
                grid_template_columns=SIDE_BY_SIDE)), self.comm_tree, self.timeline],
            "layout": [self.param, W.GridBox([self.sharding, self.peek.html], layout=W.Layout(
                grid_template_columns=SIDE_BY_SIDE)), self.layout_table],
            "pipeline": [self.pipeline],
            "experts": [self.expert_load, self.tokens_moved],
            "decoding": [self.tokens_per_step, self.kv_memory, self.step_split],
            "requests": [self.request_timeline, self.latency],
            "quantization": [self.quantization],
            "plans": [plans.widget],
        }
        self.pages = {t: css(W.VBox([self.messages[t], *pages[t]]), f"ip-view-{t}") for t in TABS}
        self.tab = css(W.Tab(children=[self.pages[t] for t in TABS], titles=[tab_title(t) for t in TABS]), "ip-views")
        self.tab.observe(lambda _c: self.refresh_selected(), names="selected_index")
        self._quiet = False
        self.param.observe(lambda _c: self._quiet or self._param_changed(), names="value")
        self.refresh_button.on_click(lambda _b: self.refresh_selected(force=True))
        actions.register(self.refresh_button)
        self.widget = css(W.VBox([row(W.HTML("<b>Views</b>"), self.refresh_button), self.tab]),
                          "ip-section", "ip-section-views")
        self.refresh_loss()

    @property
    def selected(self) -> str:
        return TABS[self.tab.selected_index or 0]

    # ---- refresh rules -------------------------------------------------------------------------
    def on_step(self) -> None:
        """A step completed while training: redraw the loss and the open tab, unless done just now."""
        now = time.monotonic()
        if now - self._last_live < self.live_interval:
            return
        self._last_live = now
        self.refresh_loss()
        if self.selected != "layout":
            self.refresh_selected()

    def refresh_loss(self) -> None:
        with self._drawing:
            history = list(self.session().history) if self.session.alive else []
            refresh(self.loss, viz.loss_figure(history))
            self.messages["loss"].value = "" if history else note("no steps yet: Train to see the loss per rank")

    def refresh_selected(self, force: bool = False) -> None:
        """Redraw the open tab from what the session holds (`force`: read the layout again too)."""
        with self._drawing:
            self._refresh(self.selected, force)

    def _refresh(self, name: str, force: bool) -> None:
        if name == "loss":
            self.refresh_loss()
        elif self.dry() is not None and name in DRY_TABS:
            self._guarded(name, lambda: getattr(self, f"_draw_dry_{name}")())
        elif not self.session.alive:
            self.messages[name].value = note("no session")
        elif name == "layout" and self.busy():
            if self._layout_key is None:
                self.messages[name].value = note("the layout is read from the ranks when they are not busy")
        else:
            self._guarded(name, lambda: getattr(self, f"_draw_{name}")(force))

    def _param_changed(self) -> None:
        with self._drawing:
            self._draw_sharding()

    def _guarded(self, name: str, draw: Callable[[], str]) -> None:
        """Run a draw; its note, or why it could not draw, goes in the tab (the error area is left
        alone: it may hold a training failure the user has not read yet)."""
        try:
            self.messages[name].value = draw()
        except Exception as exc:  # noqa: BLE001 - a view must never break the panel
            cls = "ip-bad" if isinstance(exc, RankError) else ""
            self.messages[name].value = f"<div class='{cls}'>{pre(describe_error(exc, name))}</div>"

    def _plan_key(self) -> tuple:
        s = self.session()
        return id(s), s.plan, s.spec.name if s.spec is not None else None

    # ---- one draw per tab ------------------------------------------------------------------------
    def _draw_memory(self, force: bool = False) -> str:
        s = self.session()
        key = self._plan_key()
        why = ""
        if self._predicted is None or self._predicted[0] != key or force:
            try:
                self._predicted = key, list(s.predict_memory())
            except Exception as exc:  # noqa: BLE001 - no model yet: measured bars alone
                self._predicted, why = (key, []), f"no prediction: {exc}"
        measured = s.memory()
        refresh(self.memory, viz.memory_figure(measured, self._predicted[1]))
        if why:
            return note(why)
        return "" if measured else note("predicted (hatched) only: Train a step to measure")

    def _draw_communication(self, force: bool = False) -> str:
        s = self.session()
        comms = s.comms()
        refresh(self.comm_matrix, viz.comm_matrix_figure(comms))
        refresh(self.comm_breakdown, viz.comm_breakdown_figure(comms))
        refresh(self.comm_tree, viz.comm_tree_figure(comms))
        events = s.timeline()
        refresh(self.timeline, viz.timeline_figure([e for e in events if isinstance(e, CommRecord)],
                                                   [e for e in events if isinstance(e, PipelineEvent)]))
        return "" if comms else note("no communication recorded yet: Train a step")

    def _draw_layout(self, force: bool = False) -> str:
        key = self._plan_key()
        if key == self._layout_key and not force:
            return self.messages["layout"].value
        self._shards = list(self.session().layout())
        self._layout_key = key
        names = sorted({r.param for r in self._shards})
        keep = self.param.value if self.param.value in names else (names[0] if names else None)
        self._quiet = True  # one draw below, not one per intermediate dropdown value
        try:
            self.param.options = names
            self.param.value = keep
        finally:
            self._quiet = False
        self._draw_sharding()
        return "" if names else note("no layout yet: Load a model and Apply a plan")

    def _draw_sharding(self, dry_run: bool = False) -> None:
        param = self.param.value
        if self.dry() is not None and not dry_run:
            self._shards = list(self.dry().layout(param=param))
            dry_run = True
        figure = viz.sharding_figure(self._shards, param)
        refresh(self.sharding, dry_labelled(figure) if dry_run else figure)
        self.peek.bind()
        rows = [r for r in viz.layout_table(self._shards) if r["param"] == param] if self._shards else []
        self.layout_table.value = table(SHARD_COLUMNS, [[r[c] for c in SHARD_COLUMNS] for r in rows]) if rows else ""

    def _draw_pipeline(self, force: bool = False) -> str:
        events = [e for e in self.session().timeline() if isinstance(e, PipelineEvent)]
        refresh(self.pipeline, viz.pipeline_figure(events))
        return "" if events else note("no pipeline events: Apply a plan with pp > 1 and Train")

    def _draw_experts(self, force: bool = False) -> str:
        s = self.session()
        records = s.experts(1)
        refresh(self.expert_load, viz.expert_load_figure(records))
        hidden = s.spec.hidden_size if s.spec is not None else None
        # the tokens each way are the residual stream's (fp32, or bf16 where FSDP gathers bf16 parameters)
        width = stream_bytes(s.plan) if s.plan is not None else 4
        refresh(self.tokens_moved, viz.tokens_moved_figure(records, hidden_size=hidden, dtype_bytes=width))
        if records:
            return ""
        if s.spec is None or s.spec.num_experts == 0:
            return note(f"{'no model' if s.spec is None else 'a dense model'}: Load a mixture-of-experts model")
        return note("no routing recorded yet: Train a step (Apply a plan with ep > 1 to move tokens)")

    def _draw_decoding(self, force: bool = False) -> str:
        steps = list(self.session().decoding())
        refresh(self.tokens_per_step, viz.tokens_per_step_figure(steps))
        refresh(self.kv_memory, viz.kv_memory_figure(steps))
        refresh(self.step_split, viz.step_split_figure(steps))
        return "" if steps else note("no decoding yet: Generate or Serve")

    def _draw_requests(self, force: bool = False) -> str:
        served = self.session().served()
        requests = list(served.requests) if served is not None else []
        refresh(self.request_timeline, viz.request_timeline_figure(requests))
        refresh(self.latency, viz.latency_figure(requests))
        if served is None:
            return note("no requests yet: Serve")
        return note(f"{served.engine} engine ({served.reason}), policy {served.policy}, plan {served.plan}")

    def _draw_plans(self, force: bool = False) -> str:
        return self.plans.draw()

    def _draw_quantization(self, force: bool = False) -> str:
        records = list(self.session().quantized())
        refresh(self.quantization, viz.quantization_figure(records))
        return "" if records else note("full precision: Quantize in the Serve section")

    # ---- a dry run's records (dry-run mode) ----------------------------------------------------------
    def dry(self) -> Any:
        """The kept dry run while dry-run mode is on, else None."""
        return self._dry()

    def _draw_dry_memory(self) -> str:
        dry = self.dry()
        ranks = set(shown_ranks(dry))
        predicted = [m for m in predict_memory(dry.spec, dry.plan) if m.rank in ranks]
        refresh(self.memory, dry_labelled(viz.memory_figure([m for m in dry.memory() if m.rank in ranks], predicted)))
        return label(dry)

    def _draw_dry_communication(self) -> str:
        dry = self.dry()
        comms = dry.comms(shown_ranks(dry))
        for widget, draw in ((self.comm_matrix, viz.comm_matrix_figure), (self.comm_breakdown, viz.comm_breakdown_figure)):
            refresh(widget, dry_labelled(draw(comms)))
        # every rank's, each class counted once per rank of it: the tree stays cheap on a large mesh
        refresh(self.comm_tree, dry_labelled(viz.comm_tree_figure(dry.explain_comms())))
        refresh(self.timeline, viz.timeline_figure(None))
        return label(dry) + note("no timeline in a dry run: nothing ran")

    def _draw_dry_layout(self) -> str:
        dry = self.dry()
        names = params_of(dry)
        keep = self.param.value if self.param.value in names else names[0]
        self._quiet = True
        try:
            self.param.options = names
            self.param.value = keep
        finally:
            self._quiet = False
        self._shards = list(dry.layout(param=keep))
        self._layout_key = None  # the live layout is read again when dry-run mode ends
        self._draw_sharding(dry_run=True)
        return label(dry)

    def shown_layout(self) -> tuple[str | None, list]:
        """The parameter the layout tab shows (None: none yet) and the shards last read for it."""
        return self.param.value or None, self._shards

    def forget(self) -> None:
        """The session changed: nothing drawn so far describes it."""
        self._layout_key = self._predicted = None
        self._shards = []

    def sync(self, alive: bool, busy: bool) -> None:
        self.refresh_button.disabled = busy
