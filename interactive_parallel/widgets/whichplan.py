"""The panel's "Which plan?" page: predicted step times of every plan, ranked, and the applied
plan's prediction against its measured steps.

Owns the controls of a plan search (the hardware profile: 'calibrated' once `session.calibrate()`
has run, else a shipped one; memory per rank; the world to lay out; Calibrate and Search, which
call `session.calibrate` and `session.search_plans`), the ranked table of what the search returned
(a row per StepPrediction with a bar of its compute / communication / bubble shares, re-sorted by
a click on a column's header), `viz.plans_figure` beside it, Apply and Dry run for the selected
row (`session.apply`, only when the row's world is the session's; `session.dry_run(plan, world)`),
and `viz.predicted_vs_measured_figure` of the applied plan (`session.predict_step` on the chosen
profile; the measured times are the session's history), redrawn when asked (the Views redraw the
open tab as steps arrive). The training knobs the search holds fixed come from the plan getter it
is given; a plan applied from here is an event the panel routes (the Plan section shows it).
Knows nothing of how a step is predicted or searched (plan/), nor of the other sections.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import ipywidgets as W

from .. import viz
from ..plan import Plan, PlanError
from ..plan.hardware import PROFILES
from ..plan.search import NoPlanFits
from ..records import StepPrediction
from ..viz.plans import SPLIT_COLORS, parts, ranked, shares
from ._common import Actions, SessionRef, button, css, figure_widget, refresh, row
from .events import Emit, PlanPicked
from .render import esc, note

CALIBRATED = "calibrated"
"""The profile choice that means `session.calibrated` (offered once it exists)."""
SEARCH_KNOBS = ("batch_size", "seq_len")
"""The knobs of the edited plan a search holds fixed: the work of a step (every layout, schedule,
precision and recomputation is searched)."""
TOP = 20
GiB = 2 ** 30
COLUMNS = {"rank": "plan", "seconds": "step", "tokens_per_s": "tokens/s", "mfu": "MFU", "memory": "memory",
           "split": "compute / comm / bubble"}
"""Column key -> its header; every key but 'split' sorts the table when its header is clicked."""
DESCENDING = {"tokens_per_s", "mfu"}
"""Columns whose first click puts the largest first (for the others the smallest: less time, less memory)."""
TABLE_COLUMNS = "minmax(120px, 2fr) repeat(4, minmax(64px, 1fr)) minmax(90px, 1.5fr)"
BAR_PX = 90


def default_profile(session: Any) -> str:
    """The calibrated profile when the session has one, else the shipped one of its device."""
    if getattr(session, "calibrated", None) is not None:
        return CALIBRATED
    return "cpu" if getattr(session, "device", "cpu") == "cpu" else "h100"


def seconds_text(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def split_bar(p: StepPrediction) -> str:
    """An HTML bar of the prediction's parts, each as wide as its share, in the figure's colours."""
    share = shares(p)
    spans = "".join(f"<span style='display:inline-block;height:10px;width:{share[k] * BAR_PX:.1f}px;"
                    f"background:{SPLIT_COLORS[k]}'></span>" for k in parts(p))
    title = ", ".join(f"{k} {v:.0%}" for k, v in share.items())
    return f"<span class='ip-plan-bar' title='{esc(title)}' style='white-space:nowrap'>{spans}</span>"


def sort_key(column: str) -> Callable[[tuple[int, StepPrediction]], Any]:
    """The key of a (search rank, prediction) pair for a column."""
    return {"rank": lambda item: item[0], "seconds": lambda item: item[1].seconds,
            "tokens_per_s": lambda item: item[1].tokens_per_s, "mfu": lambda item: item[1].mfu,
            "memory": lambda item: item[1].memory_bytes}[column]


class PlanTable:
    """The ranked predictions as a grid: a header of sort buttons, a row per plan (its label a
    button that selects it), re-ordered in place when a header is clicked."""

    def __init__(self, on_select: Callable[[], None]):
        self.on_select = on_select
        self.rows: list[StepPrediction] = []
        self.order: list[int] = []
        """Search ranks (indices into rows) in the order shown."""
        self.column, self.descending = "rank", False
        self.selected: int | None = None
        self.headers = {k: css(W.Button(description=h, layout=W.Layout(width="auto")), "ip-plans-header",
                               f"ip-plans-sort-{k.replace('_', '-')}") for k, h in COLUMNS.items()}
        for key, header in self.headers.items():
            if key != "split":
                header.on_click(lambda _b, key=key: self.sort(key))
            else:
                header.disabled = True
        self._cells: list[list[W.Widget]] = []
        self.widget = css(W.GridBox(list(self.headers.values()), layout=W.Layout(
            grid_template_columns=TABLE_COLUMNS, grid_gap="1px 6px", align_items="center", width="100%")),
            "ip-plans-table")

    def show(self, predictions: list[StepPrediction]) -> None:
        """New rows, in the search's order, none selected."""
        self.rows, self.selected = list(predictions), None
        self.column, self.descending = "rank", False
        self._cells = [self._row(i, p) for i, p in enumerate(self.rows)]
        self.sort("rank", toggle=False)

    def _row(self, i: int, p: StepPrediction) -> list[W.Widget]:
        pick = css(W.Button(description=f"{i + 1}. {p.plan}", tooltip=f"select {p.plan} (Apply, Dry run)",
                            layout=W.Layout(width="auto")), "ip-plans-row")
        pick.on_click(lambda _b: self.select(i))
        grey = "" if p.fits else " style='opacity:0.55'"
        memory = viz.human_bytes(p.memory_bytes) + ("" if p.fits else " <b class='ip-bad'>does not fit</b>")
        cells = [seconds_text(p.seconds), f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}", memory, split_bar(p)]
        return [pick, *(css(W.HTML(f"<span{grey}>{c}</span>"), "ip-plans-cell") for c in cells)]

    def sort(self, column: str, toggle: bool = True) -> None:
        """Order the rows by `column`; clicking the column it is sorted by reverses it."""
        if toggle and column == self.column:
            self.descending = not self.descending
        elif toggle:
            self.column, self.descending = column, column in DESCENDING
        key = sort_key(column)
        self.order = [i for i, _ in sorted(enumerate(self.rows), key=key, reverse=self.descending)]
        for k, header in self.headers.items():
            header.description = COLUMNS[k] + ((" ▼" if self.descending else " ▲") if k == column else "")
        self.widget.children = [*self.headers.values(), *(c for i in self.order for c in self._cells[i])]

    def shown(self) -> list[StepPrediction]:
        """The rows in the order shown."""
        return [self.rows[i] for i in self.order]

    def select(self, i: int | None) -> None:
        self.selected = i
        for k, cells in enumerate(self._cells):
            cells[0].button_style = "info" if k == i else ""
        self.on_select()

    @property
    def current(self) -> StepPrediction | None:
        return None if self.selected is None else self.rows[self.selected]


class WhichPlanSection:
    """Profile, memory and world, Calibrate and Search; the ranked table and figure; Apply and Dry
    run of the selected plan; the applied plan's predicted against measured step time."""

    def __init__(self, session: SessionRef, actions: Actions, plan: Callable[[], Plan], emit: Emit):
        self.session, self.actions, self.edited, self.emit = session, actions, plan, emit
        self._drawing = threading.RLock()
        """Held while the step-time figure is redrawn (a job's thread may ask while a click does)."""
        s = session()
        self.profile = css(W.Dropdown(options=self._profiles(), value=default_profile(s), description="profile",
                                      layout=W.Layout(width="190px")), "ip-plans-profile")
        self.memory = css(W.BoundedFloatText(value=0.0, min=0.0, max=1e6, step=1.0, description="GiB per rank",
                                             tooltip="memory per rank a plan must fit (0: the profile's)",
                                             style={"description_width": "initial"}, layout=W.Layout(width="170px")),
                          "ip-plans-memory")
        self.world = css(W.BoundedIntText(value=getattr(s, "world_size", 0) or 4, min=1, max=1 << 20,
                                          description="world", tooltip="ranks to lay the plans out on",
                                          layout=W.Layout(width="150px")), "ip-plans-world")
        self.calibrate = button("Calibrate", "ip-calibrate-button",
                                tooltip="session.calibrate(): time matmuls, operations and collectives on the ranks")
        self.search = button("Search", "ip-search-plans-button", style="primary",
                             tooltip="session.search_plans(profile, memory_per_rank=..., world=...)")
        self.status = css(W.HTML(), "ip-plans-status")
        self.table = PlanTable(self._selected)
        self.figure = figure_widget(viz.plans_figure(None), "ip-plans-figure", 420)
        self.apply = button("Apply", "ip-apply-plan-button", style="primary", tooltip="session.apply(selected plan)")
        self.dry_run = button("Dry run", "ip-dry-run-plan-button",
                              tooltip="session.dry_run(selected plan, world): its layout on fake tensors, here")
        self.selection = css(W.HTML(note("select a plan in the table")), "ip-plans-selection")
        self.step_time = figure_widget(viz.predicted_vs_measured_figure(None, None), "ip-step-time-figure", 320)
        self.results: list[StepPrediction] = []
        self._predicted: tuple[tuple, StepPrediction | None, str] | None = None
        self._busy = self._quiet = False
        actions.register(self.profile, self.memory, self.world)
        actions.on_click(self.calibrate, "calibrate", self._calibrate)
        actions.on_click(self.search, "search plans", self._search)
        actions.on_click(self.apply, "apply", self._apply)
        actions.on_click(self.dry_run, "dry run", self._dry_run)
        self.profile.observe(lambda _c: self._quiet or self.draw(), names="value")
        side_by_side = f"repeat(auto-fit, minmax(min(100%, {viz.TITLE_FITS_PX}px), 1fr))"
        self.figures = {"ip-plans-figure": self.figure, "ip-step-time-figure": self.step_time}
        """CSS class -> FigureWidget (the panel fits them to their column)."""
        self.widget = css(W.VBox([
            W.HTML("<b>Which plan?</b> predicted step time of every layout, ranked"),
            row(self.profile, self.calibrate, self.memory, self.world, self.search), self.status,
            W.GridBox([css(W.VBox([self.table.widget]), "ip-scroll"), self.figure],
                      layout=W.Layout(grid_template_columns=side_by_side, grid_gap="6px")),
            row(self.apply, self.dry_run, self.selection), self.step_time]), "ip-which-plan")

    # ---- the profile -------------------------------------------------------------------------------
    def _profiles(self) -> list[str]:
        s = self.session()
        calibrated = [CALIBRATED] if getattr(s, "calibrated", None) is not None else []
        return [*calibrated, *PROFILES]

    def chosen_profile(self) -> Any:
        """What the dropdown names, as Session takes it: the calibrated HardwareProfile, or a shipped name."""
        return self.session().calibrated if self.profile.value == CALIBRATED else self.profile.value

    def _offer_profiles(self, value: str | None = None) -> None:
        options = self._profiles()
        keep = value if value in options else self.profile.value if self.profile.value in options \
            else default_profile(self.session())
        self._quiet = True  # one redraw (the caller's), not one per intermediate value
        try:
            self.profile.options = options
            self.profile.value = keep
        finally:
            self._quiet = False

    # ---- actions -----------------------------------------------------------------------------------
    def _calibrate(self) -> None:
        profile = self.session.require().calibrate()
        self._offer_profiles(CALIBRATED)
        self.status.value = note(f"calibrated {profile.name}: {profile.source}" if profile.source
                                 else f"calibrated {profile.name}")
        self.draw()

    def fixed(self) -> tuple[dict[str, Any], str]:
        """The knobs the search holds fixed (the edited plan's) and how the status says them."""
        try:
            plan = self.edited()
        except (PlanError, ValueError, TypeError) as exc:
            return {}, f"the session's knobs (the edited plan cannot be read: {exc})"
        knobs = {k: getattr(plan, k) for k in SEARCH_KNOBS}
        return knobs, f"batch {plan.batch_size} x seq {plan.seq_len}"

    def _search(self) -> None:
        s = self.session.require()
        memory = int(self.memory.value * GiB) if self.memory.value > 0 else None
        fixed, knobs = self.fixed()
        try:
            found = list(s.search_plans(self.chosen_profile(), memory_per_rank=memory, world=self.world.value,
                                        top=TOP, **fixed))
        except PlanError as exc:  # no stale rows beside the refusal; the closest plan, greyed, when one came near
            closest = exc.closest if isinstance(exc, NoPlanFits) else None
            self._show([closest] if closest is not None else [])
            self.status.value = note("no plan fits: the closest is shown, greyed" if closest else "no plan")
            raise
        self._show(found)
        if not found:
            self.status.value = note(f"no plan lays {s.spec.name if s.spec else 'the model'} out on "
                                     f"{self.world.value} ranks")
            return
        best, unfit = ranked(found)[0], sum(not p.fits for p in found)
        self.status.value = (f"{len(found)} plans on {self.world.value} ranks, profile {esc(found[0].profile)}, "
                             f"{esc(knobs)}: best <b>{esc(best.plan)}</b> ({seconds_text(best.seconds)}, "
                             f"{best.tokens_per_s:,.0f} tokens/s)" + (f"; {unfit} not fitting" if unfit else ""))

    def _show(self, found: list[StepPrediction]) -> None:
        self.results = found
        self.table.show(found)
        self._selected()
        refresh(self.figure, viz.plans_figure(found, top=TOP))

    def plan_of(self, p: StepPrediction) -> Plan:
        """The row's Plan, on the session's device (the device is the session's, the layout the row's)."""
        plan = Plan.from_dict(p.plan_fields)
        return plan.replace(device=getattr(self.session(), "device", plan.device))

    def _apply(self) -> None:
        s, p = self.session.require(), self.table.current
        plan = self.plan_of(p)
        if plan.world_size != s.world_size:
            raise ValueError(f"{p.plan} lays out {plan.world_size} ranks, the session has {s.world_size}: "
                             "Dry run it instead")
        s.apply(plan)
        self.selection.value = note(f"applied {plan.describe()}")
        self.emit(PlanPicked(plan))

    def _dry_run(self) -> None:
        s, p = self.session.require(), self.table.current
        plan = self.plan_of(p)
        dry = s.dry_run(plan, world=plan.world_size)
        peak = max((m.params + m.grads + m.optimizer + (m.activations or 0) for m in dry.memory()), default=0)
        self.selection.value = note(
            f"dry run of {plan.describe()} on {dry.world} virtual ranks: peak {viz.human_bytes(peak)} per rank "
            f"(predicted {viz.human_bytes(p.memory_bytes)}), {len(dry.simulated)} simulated, {dry.seconds:.1f} s")

    def _selected(self) -> None:
        """A row was picked (or the rows changed): say what Apply and Dry run would do."""
        p = self.table.current
        self.sync(self.session.alive, self._busy)
        if p is None:
            self.selection.value = note("select a plan in the table")
            return
        world = self.plan_of(p).world_size
        ranks = self.session().world_size if self.session.alive else None
        why = "" if world == ranks else f"; Apply needs {world} ranks, the session has {ranks}: Dry run it"
        self.selection.value = note(f"{p.plan}: {seconds_text(p.seconds)} per step on {p.profile}{why}")

    # ---- the applied plan's step time ----------------------------------------------------------------
    def draw(self) -> str:
        """Redraw the applied plan's predicted against measured step time; the note for the page."""
        with self._drawing:
            if not self.session.alive:
                refresh(self.step_time, viz.predicted_vs_measured_figure(None, None))
                return note("no session")
            s = self.session()
            predicted, why = self._prediction(s)
            label = s.plan.describe() if s.plan is not None else None
            times = viz.step_times(s.history, label) if label is not None else []
            refresh(self.step_time, viz.predicted_vs_measured_figure(times, predicted))
            if why:
                return note(why)
            return "" if times else note(f"predicted for {label}: Train to measure its steps")

    def _prediction(self, s: Any) -> tuple[StepPrediction | None, str]:
        """The applied plan's prediction on the chosen profile, once per (session, plan, model, profile)."""
        if s.plan is None or s.spec is None:
            return None, "no plan applied yet: Load a model and Apply a plan (here or in the Plan section)"
        profile = self.chosen_profile()
        key = (id(s), s.plan, s.spec.name, self.profile.value, id(profile))
        if self._predicted is None or self._predicted[0] != key:
            try:
                self._predicted = key, s.predict_step(profile=profile), ""
            except Exception as exc:  # noqa: BLE001 - a prediction must never break the page
                self._predicted = key, None, f"no prediction: {type(exc).__name__}: {exc}"
        return self._predicted[1], self._predicted[2]

    def forget(self) -> None:
        """The session changed: its results, profiles and world are not the old one's."""
        self.results, self._predicted = [], None
        self.table.show([])
        refresh(self.figure, viz.plans_figure(None))
        self.status.value = ""
        self._offer_profiles()
        if self.session.alive:
            self.world.value = self.session().world_size
        self._selected()

    def sync(self, alive: bool, busy: bool) -> None:
        self._busy = busy
        off = not alive or busy
        self.calibrate.disabled = self.search.disabled = off
        self.profile.disabled = self.memory.disabled = self.world.disabled = busy
        picked = self.table.current is not None
        self.dry_run.disabled = off or not picked
        fits_ranks = picked and alive and self.plan_of(self.table.current).world_size == self.session().world_size
        self.apply.disabled = off or not fits_ranks
