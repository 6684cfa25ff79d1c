"""The Plan section's mesh and its dry-run mode.

Owns the mesh figure of the plan being edited (`viz.mesh_figure`: every rank a cell coloured by
its predicted memory, redrawn as the pickers change; for the applied plan, by what the ranks
measured, with the links of their last step's collectives), the "dry run" switch that lets the plan's
world exceed the live ranks, the Dry run button (`session.dry_run(plan)` for the loaded model,
else `interactive_parallel.dry_run(model, plan)`: the runtime's own layout and training step
on fake tensors in this process, no rank touched) and the DryRun it keeps. While the switch is
on and a dry run of the edited model is kept, the mesh and the Views' memory, communication
and layout figures draw its records, labelled "dry run". Knows nothing of how a dry run works:
it holds what the call returned.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ipywidgets as W

from .. import viz
from ._common import button, css, figure_widget, refresh, row
from .render import esc, note

if TYPE_CHECKING:
    from .panel import Panel

MESH_HEIGHT = 300
FEW_RANKS = 64
"""Up to this many ranks the dry run's figures show every rank; beyond, one rank per class."""


class DryView:
    """The mesh figure, the dry-run switch and button, and the last dry run."""

    def __init__(self, panel: "Panel", section: Any):
        self.panel, self.section = panel, section
        self.result: Any = None
        """The last DryRun (runtime.dryrun.DryRun), or None."""
        self.switch = css(W.Checkbox(value=False, description="dry run", indent=False, layout=W.Layout(width="auto"),
                                     tooltip="lay the plan out on fake tensors in this process: its world may exceed "
                                             "the live ranks, and the figures draw the dry run's records"),
                          "ip-dry-run")
        self.run = button("Dry run", "ip-dry-run-button",
                          tooltip="session.dry_run(plan), or interactive_parallel.dry_run(model, plan) without a "
                                  "session: the runtime's own code on fake tensors, here (a 70B model on 1,024 "
                                  "ranks takes about a minute)")
        self.status = css(W.HTML(), "ip-dry-run-status")
        self.mesh = figure_widget(viz.mesh_figure({}), "ip-mesh-figure", MESH_HEIGHT)
        self.switch.observe(lambda _c: self.changed(), names="value")
        panel.actions.on_click(self.run, "dry run", self._dry_run)
        self.widget = W.VBox([row(self.switch, self.run, self.status), self.mesh])

    @property
    def on(self) -> bool:
        return bool(self.switch.value)

    def current(self) -> Any:
        """The kept DryRun while the switch is on, else None."""
        return self.result if self.on else None

    def changed(self) -> None:
        self.section.revalidate()
        self.panel.sync()
        self.panel.views.refresh_selected()

    def _dry_run(self) -> None:
        plan = self.section.plan()
        s = self.panel.session
        if self.panel.alive and s.spec is not None:
            self.result = s.dry_run(plan)
        else:
            from .. import dry_run

            self.result = dry_run(self.section.model_choice(), plan)
        self.status.value = note(describe(self.result))
        self.draw(plan, self.section.predicted)
        self.panel.views.refresh_selected()

    def draw(self, plan: Any, predicted: list | None) -> None:
        """The mesh of `plan` (or an empty one when it cannot run), coloured by `predicted` and, when
        the kept dry run is of this plan, by its records with its links."""
        if plan is None:
            refresh(self.mesh, viz.mesh_figure({}))
            return
        dry = self.current()
        if dry is not None and dry.plan.replace(device=plan.device) == plan:
            param = self.panel.views.param.value if self.panel.views.param.value else None
            shards = dry.layout(param=param) if param in params_of(dry) else None
            refresh(self.mesh, viz.mesh_figure(plan, memory=dry.memory(), predicted=predicted, shards=shards,
                                               param=param, comms=dry.iter_comms(shown_ranks(dry)),
                                               source="dry run"))
        elif self.panel.alive and self.panel.session.plan == plan:
            s, views = self.panel.session, self.panel.views  # the applied plan: what the ranks measured
            shards = [r for r in views._shards if r.param == views.param.value] or None
            refresh(self.mesh, viz.mesh_figure(plan, memory=s.memory(), predicted=predicted, shards=shards,
                                               param=views.param.value or None, comms=s.comms(), source="live"))
        else:
            refresh(self.mesh, viz.mesh_figure(plan, predicted=predicted, source="predicted"))

    def sync(self, alive: bool, busy: bool) -> None:
        self.run.disabled = busy or not self.on
        self.switch.disabled = busy


def describe(dry: Any) -> str:
    return (f"dry run: {dry.spec.name} {dry.plan.describe()} on {dry.world} virtual ranks, "
            f"{len(dry.simulated)} simulated, {dry.seconds:.1f} s")


def shown_ranks(dry: Any) -> list[int]:
    """Every rank of a small mesh; one per class of a large one (their figures stay readable)."""
    return list(range(dry.world)) if dry.world <= FEW_RANKS else dry.representatives


def params_of(dry: Any) -> list[str]:
    return sorted({s.param for sim in dry.simulated.values() for s in sim.shards})


def label(dry: Any) -> str:
    """The note the Views show above a dry run's figures."""
    which = "" if dry.world <= FEW_RANKS else f"; ranks {', '.join(map(str, dry.representatives))} (one per class)"
    return f"<div class='ip-dry-label'>{esc(describe(dry) + which)}</div>"
