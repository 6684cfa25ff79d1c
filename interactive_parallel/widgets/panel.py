"""The control panel: one widget that drives a Session from JupyterLab.

Owns the composition of the sections (the controls, Cluster, Plan, Run and Serve, in one column of
ipywidgets' AppLayout; the Views tab of live figures beside them, so the figures stay in view
while the buttons are pressed; the Which plan? page is one of its tabs), what they share (the one error area and its action runner, the
job runner, the prompts and sampling controls), which session the panel drives (its Cluster
section may start, attach to or stop one), and the busy/idle state that decides which controls
are enabled. It is the only module that knows the sections: each gets getters and shared objects
at construction and raises typed events (widgets/events.py), which `notify` routes. Knows nothing
that a script could not do: every button is a public Session method, so a workshop can copy any
of it into a cell.
"""
from __future__ import annotations

from typing import Any, Callable

import ipywidgets as W

from ._common import Actions, SessionRef, css
from .cluster import ClusterSection
from .events import DryRunChanged, Event, JobEnded, JobStarted, PlanPicked, RanksChanged, SessionChosen, StepDone
from .fit import FitFigures
from .jobs import Job, JobRunner
from .planner import PlanSection
from .render import STYLE
from .run import RunSection
from .sampling import Sampling
from .serve import ServeSection
from .views import ViewsSection
from .whichplan import WhichPlanSection

CONTROLS_WIDTH = "500px"
"""The controls' column; the figures take the rest of the width."""
CONTROLS_HEIGHT = "820px"
"""Past this the controls scroll inside their column, so the panel (and its figures) fits a screen."""


class Panel(W.VBox):
    """The panel for `session` (None: its Cluster section starts one). Display it as a cell's value.

    >>> p = interactive_parallel.panel(session)
    >>> p                           # in a notebook: the controls beside the live figures
    """

    def __init__(self, session: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.session = session
        self.errors = css(W.Output(), "ip-error-output")
        self.actions = Actions(self.errors, sync=self.sync)
        current = SessionRef(lambda: self.session)
        emit = self.notify
        self.jobs = JobRunner(current, self.actions, emit)
        self.sampling = Sampling(self.actions)
        self.cluster = ClusterSection(current, self.actions, lambda: self.jobs.activity, emit)
        self.plan_section = PlanSection(current, self.actions, lambda: self.world_size, lambda: self.device,
                                        lambda: self.views.shown_layout(), emit)
        self.run_section = RunSection(current, self.actions, self.jobs, self.sampling, self.plan_section.plan, emit)
        self.serve_section = ServeSection(current, self.actions, self.jobs, self.sampling, emit)
        self.which_plan = WhichPlanSection(current, self.actions, self.plan_section.plan, emit)
        self.views = ViewsSection(current, self.actions, lambda: self.jobs.running, self.plan_section.dry.current,
                                  self.which_plan)
        self.cluster.ranks.observe(lambda _c: self.plan_section.revalidate(), names="value")
        self.cluster.device.observe(lambda _c: self.plan_section.revalidate(), names="value")
        sections = [self.cluster.widget, self.plan_section.widget, self.run_section.widget,
                    self.serve_section.widget]
        for section in sections:
            section.layout.flex = "0 0 auto"  # scroll the column, never squeeze a section into its neighbour
        controls = css(W.VBox(sections, layout=W.Layout(max_height=CONTROLS_HEIGHT, overflow_y="auto")),
                       "ip-controls")
        self.columns = css(W.AppLayout(left_sidebar=controls, center=self.views.widget, grid_gap="8px",
                                       pane_widths=[CONTROLS_WIDTH, 1, 0], align_items="flex-start"), "ip-columns")
        title = css(W.HTML("<h3 style='margin:4px 0'>interactive_parallel</h3>"), "ip-title")
        fitted = {**self.views.figures, "ip-mesh-figure": self.plan_section.dry.mesh}
        self.children = [W.HTML(STYLE), FitFigures(fitted), title, self.errors, self.columns]
        self.add_class("ip-panel")
        self.sync()
        self.plan_section.revalidate()

    # ---- what the sections are given ------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.session is not None and self.session.alive

    @property
    def activity(self) -> str:
        """What the running job does ('training', ...); '' when the panel is idle."""
        return self.jobs.activity

    @property
    def world_size(self) -> int:
        return self.session.world_size if self.alive else self.cluster.ranks.value

    @property
    def device(self) -> str:
        return self.session.device if self.alive else self.cluster.device.value

    def set_session(self, session: Any) -> None:
        """Drive `session` from now on (None: none); the pickers take its plan."""
        self.session = session
        self.views.forget()
        self.which_plan.forget()
        if self.alive and session.plan is not None:
            self.plan_section.show(session.plan)
        self.sync()
        self.redraw()

    def sync(self) -> None:
        """Each control's enabled state from what is true now."""
        alive, busy = self.alive, bool(self.jobs.activity)
        for part in (self.cluster, self.plan_section, self.jobs, self.sampling, self.run_section,
                     self.serve_section, self.views, self.which_plan):
            part.sync(alive, busy)

    def redraw(self) -> None:
        """What the ranks hold or did changed: the plan's checks, the loss and the open tab."""
        self.plan_section.revalidate()
        self.views.refresh_loss()
        self.views.refresh_selected()

    def notify(self, event: Event) -> None:
        """Route an event a section raised to what depends on it (the one place that does)."""
        match event:
            case StepDone():
                self.views.on_step()
            case JobStarted():
                self.cluster.show_status()
            case SessionChosen(session=session):
                self.set_session(session)
            case JobEnded():
                self.sync()
                self.redraw()
            case RanksChanged():
                self.redraw()
            case PlanPicked(plan=plan):
                self.plan_section.show(plan)
                self.redraw()
            case DryRunChanged():
                self.plan_section.revalidate()
                self.sync()
                self.views.refresh_selected()
            case _:
                raise TypeError(f"not a panel event: {event!r}")

    # ---- the same things from a cell (tests drive these) ----------------------------------------
    def train(self, steps: int | None = None) -> Job | None:
        """Click Train (with `steps` typed first); the Job, whose `wait()` works outside a kernel."""
        if steps is not None:
            self.run_section.steps.value = steps
        return self.run_section.start_training()

    def generate(self, prompts: str | None = None) -> Job | None:
        """Click Generate (with `prompts`, one per line, typed first); the Job."""
        if prompts is not None:
            self.sampling.prompts.value = prompts
        return self.run_section.start_generating()

    def serve(self, count: int | None = None, **controls: Any) -> Job | None:
        """Click Serve (with `count` requests and any Serve control, e.g. policy='static', set first); the Job."""
        section = self.serve_section
        if count is not None:
            section.count.value = count
        for name, value in controls.items():
            getattr(section, name).value = value
        return section.start_serving()

    def quantize(self, scheme: str | None = None) -> None:
        """Click Quantize (with `scheme` picked first)."""
        if scheme is not None:
            self.serve_section.scheme.value = scheme
        self.serve_section.quantize.click()

    def wait(self, timeout: float | None = None) -> bool:
        """Outside a kernel: block until the training, generation or serving started from the panel ends."""
        return self.jobs.wait(timeout)

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list | None:
        """session.run(fn, ...) with the panel's error path: a failing rank is shown by number."""
        return self.run_section.run_function(fn, *args, **kwargs)

    @property
    def error_text(self) -> str:
        """What the error area shows, as text."""
        return "".join(o.get("text", "") for o in self.errors.outputs)


def panel(session: Any = None) -> Panel:
    """A control panel for `session`; with None its Cluster section starts one."""
    return Panel(session)
