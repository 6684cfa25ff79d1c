"""The Plan section's mesh and its dry-run mode.

Owns the mesh figure of the plan being edited (`viz.mesh_figure`: every rank a cell coloured by
its predicted memory, redrawn as the pickers change; for the applied plan, by what the ranks
measured, with the links of their last step's collectives), the "dry run" switch that lets the
plan's world exceed the live ranks, the Dry run button (`session.dry_run(plan)` for the loaded
model, else `cluster.offline.dry_run(model, plan)`, which `interactive_parallel.dry_run` runs
too: the runtime's own layout and training step on fake tensors in this process, no rank
touched) and the DryRun it keeps. While the switch is on and a dry run of the edited model is
kept, the mesh and the Views' memory, communication and layout figures draw its records,
labelled "dry run". The plan and model being edited, and the parameter (and live shards) the
Views' layout tab shows, come from getters it is given; a flipped switch or a new dry run is an
event the panel routes. Knows nothing of how a dry run works (it holds what the call returned),
nor of the sections around it.
"""
from __future__ import annotations

from typing import Any, Callable

import ipywidgets as W

from .. import viz
from ..cluster.offline import dry_run
from ._common import Actions, SessionRef, button, css, figure_widget, refresh, row
from .events import DryRunChanged, Emit
from .render import esc, note

MESH_HEIGHT = 300
FEW_RANKS = 64
"""Up to this many ranks the dry run's figures show every rank; beyond, one rank per class."""
ShownLayout = Callable[[], tuple[Any, list]]
"""The parameter the Views' layout tab shows (None: none yet) and the live shards it read."""


class DryView:
    """The mesh figure, the dry-run switch and button, and the last dry run."""

    def __init__(self, session: SessionRef, actions: Actions, plan: Callable[[], Any], model: Callable[[], str],
                 shown_layout: ShownLayout, emit: Emit):
        self.session, self.plan, self.model, self.shown_layout, self.emit = session, plan, model, shown_layout, emit
        self.result: Any = None
        """The last DryRun (runtime.client.dryrun.DryRun), or None."""
        self.switch = css(W.Checkbox(value=False, description="dry run", indent=False, layout=W.Layout(width="auto"),
                                     tooltip="lay the plan out on fake tensors in this process: its world may exceed "
                                             "the live ranks, and the figures draw the dry run's records"),
                          "ip-dry-run")
        self.run = button("Dry run", "ip-dry-run-button",
                          tooltip="session.dry_run(plan), or interactive_parallel.dry_run(model, plan) without a "
                                  "session: the runtime's own code on fake tensors, here (a large model on "
                                  "thousands of virtual ranks takes a while)")
        self.status = css(W.HTML(), "ip-dry-run-status")
        self.mesh = figure_widget(viz.mesh_figure({}), "ip-mesh-figure", MESH_HEIGHT)
        self.switch.observe(lambda _c: self.emit(DryRunChanged()), names="value")
        actions.on_click(self.run, "dry run", self._dry_run)
        self.widget = W.VBox([row(self.switch, self.run, self.status), self.mesh])

    @property
    def on(self) -> bool:
        return bool(self.switch.value)

    def current(self) -> Any:
        """The kept DryRun while the switch is on, else None."""
        return self.result if self.on else None

    def _dry_run(self) -> None:
        plan = self.plan()
        s = self.session()
        if self.session.alive and s.spec is not None:
            self.result = s.dry_run(plan)
        else:
            self.result = dry_run(self.model(), plan)
        self.status.value = note(describe(self.result))
        self.emit(DryRunChanged())

    def draw(self, plan: Any, predicted: list | None) -> None:
        """The mesh of `plan` (or an empty one when it cannot run), coloured by `predicted` and, when
        the kept dry run is of this plan, by its records with its links."""
        if plan is None:
            refresh(self.mesh, viz.mesh_figure({}))
            return
        dry = self.current()
        param, live_shards = self.shown_layout()
        spec = self._spec(dry)
        counts = dict(num_experts=spec.num_experts, num_layers=spec.num_layers) if spec is not None else {}
        if dry is not None and dry.plan.replace(device=plan.device) == plan:
            shards = dry.layout(param=param) if param in params_of(dry) else None
            refresh(self.mesh, viz.mesh_figure(plan, memory=dry.memory(), predicted=predicted, shards=shards,
                                               param=param, comms=dry.iter_comms(shown_ranks(dry)),
                                               source="dry run", **counts))
        elif self.session.alive and self.session().plan == plan:
            s = self.session()  # the applied plan: what the ranks measured
            shards = [r for r in live_shards if r.param == param] or None
            refresh(self.mesh, viz.mesh_figure(plan, memory=s.memory(), predicted=predicted, shards=shards,
                                               param=param, comms=s.comms(), source="live",
                                               **counts))
        else:
            refresh(self.mesh, viz.mesh_figure(plan, predicted=predicted, source="predicted", **counts))

    def _spec(self, dry: Any) -> Any:
        """The spec of the model the mesh is drawn for (its experts and layers name the cells), or None."""
        if dry is not None:
            return dry.spec
        if self.session.alive and self.session().spec is not None:
            return self.session().spec
        return None

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
