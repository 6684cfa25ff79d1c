"""The control panel: one widget that drives a Session from JupyterLab.

Owns the composition of the sections (the controls, Cluster, Plan, Run and Serve, in one column of
ipywidgets' AppLayout; the Views tab of live figures beside them, so the figures stay in view
while the buttons are pressed), the one error area they share, which session the panel drives
(it may start, attach to or stop one), and the busy/idle state that decides which controls are
enabled. Knows nothing that a script could not do: every button is a public Session method, so
a workshop can copy any of it into a cell.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import ipywidgets as W

from ..cluster.errors import SessionError
from ._common import Actions, css
from .cluster import ClusterSection
from .fit import FitFigures
from .planner import PlanSection
from .render import STYLE
from .run import RunSection
from .serve import ServeSection
from .views import ViewsSection

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
        self.activity: str = ""
        self.errors = css(W.Output(), "ip-error-output")
        self.actions = Actions(self.errors, sync=self.sync)
        self.cluster = ClusterSection(self)
        self.plan_section = PlanSection(self)
        self.run_section = RunSection(self)
        self.serve_section = ServeSection(self)
        self.views = ViewsSection(self)
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

    # ---- what the sections ask of the panel ----------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.session is not None and self.session.alive

    @property
    def world_size(self) -> int:
        return self.session.world_size if self.alive else self.cluster.ranks.value

    @property
    def device(self) -> str:
        return self.session.device if self.alive else self.cluster.device.value

    def require(self) -> Any:
        if not self.alive:
            raise SessionError("no session: start one in the Cluster section (Start or Attach)")
        return self.session

    def set_session(self, session: Any) -> None:
        self.session = session
        self.views.forget()
        if self.alive and session.plan is not None:
            self.plan_section.show(session.plan)
        self.notify("session")

    def begin(self, activity: str, keep: Iterable[W.DOMWidget] = ()) -> None:
        """Long work started: every action control off except `keep` (the Stop button)."""
        self.activity = activity
        self.actions.freeze(keep)
        self.cluster.status.value = self.cluster.status_html()

    def end(self) -> None:
        self.activity = ""
        self.sync()

    def sync(self) -> None:
        """Each control's enabled state from what is true now."""
        alive, busy = self.alive, bool(self.activity)
        for section in (self.cluster, self.plan_section, self.run_section, self.serve_section, self.views):
            section.sync(alive, busy)

    def notify(self, event: str) -> None:
        """Something changed ('session', 'model', 'plan', 'step', 'trained', 'served'): redraw what
        depends on it."""
        if event == "step":
            self.views.on_step()
            return
        if event == "session":
            self.sync()
        self.plan_section.revalidate()
        self.views.refresh_loss()
        self.views.refresh_selected()

    # ---- the same things from a cell (tests drive these) ----------------------------------------
    def train(self, steps: int | None = None):
        """Click Train (with `steps` typed first); the Job, whose `wait()` works outside a kernel."""
        if steps is not None:
            self.run_section.steps.value = steps
        return self.run_section.start_training()

    def generate(self, prompts: str | None = None):
        """Click Generate (with `prompts`, one per line, typed first); the Job."""
        if prompts is not None:
            self.run_section.prompts.value = prompts
        return self.run_section.start_generating()

    def serve(self, count: int | None = None, **controls: Any):
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
        job = self.run_section.job
        return True if job is None else job.wait(timeout)

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
