"""The control panel: one widget that drives a Session from JupyterLab.

Owns the composition of the sections (Cluster, Plan, Run, Views), the one error area they
share, which session the panel drives (it may start, attach to or stop one), and the
busy/idle state that decides which controls are enabled. Knows nothing that a script could not
do: every button is a public Session method or a pure plan/ or viz/ function, so a workshop
can copy any of it into a cell.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import ipywidgets as W

from ..cluster.errors import SessionError
from ._common import Actions, css
from .cluster import ClusterSection
from .planner import PlanSection
from .run import RunSection
from .views import ViewsSection


class Panel(W.VBox):
    """The panel for `session` (None: its Cluster section starts one). Display it as a cell's value.

    >>> p = Panel(session)          # or session.panel()
    >>> p                           # in a notebook: shows the controls and the live figures
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
        self.views = ViewsSection(self)
        self.cluster.ranks.observe(lambda _c: self.plan_section.revalidate(), names="value")
        self.cluster.device.observe(lambda _c: self.plan_section.revalidate(), names="value")
        self.children = [css(W.HTML("<h3 style='margin:4px 0'>interactive_parallel</h3>"), "ip-title"),
                         self.errors, self.cluster.widget, self.plan_section.widget, self.run_section.widget,
                         self.views.widget]
        self.add_class("ip-panel")
        self.sync()
        self.plan_section.revalidate()

    # ---- what the sections ask of the panel ----------------------------------------------------
    @property
    def alive(self) -> bool:
        # A stopped Session drops its pool; a stand-in without one counts as alive.
        return self.session is not None and getattr(self.session, "_pool", True) is not None

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
        for section in (self.cluster, self.plan_section, self.run_section, self.views):
            section.sync(alive, busy)

    def notify(self, event: str) -> None:
        """Something changed ('session', 'model', 'plan', 'step', 'trained'): redraw what depends on it."""
        if event == "step":
            self.views.refresh_loss()
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

    def wait(self, timeout: float | None = None) -> bool:
        """Outside a kernel: block until training started from the panel ends."""
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
