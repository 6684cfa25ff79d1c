"""The records of a plan on a virtual mesh: what a dry run returns, and the classes of ranks it simulates.

Owns which ranks are alike (`rank_classes`: the same pipeline coordinate and the same sizes of
every tensor held, from plan.inventory.local_tensors; only FSDP over a dimension it does not
divide evenly makes ranks of one stage differ) and how a representative's records become
another rank's of its class (`move`: groups and peers follow the mesh; `DryRun.mover`, the
simulator's, recomputes index ranges), and the DryRun that holds them: `memory()`, `comms()`,
`layout()`, `lint()`, `explain_comms()`, the same record types a live Session returns, so viz/
and the panel draw both.
Pure Python: knows no torch and nothing of how ranks are simulated (runtime/client/dryrun.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

from ..records import CommRecord, LintFinding, MemoryRecord, RecordList, ShardRecord, StepRecord, comm_tree
from ..records.lint import LINT_COLUMNS, merged
from .axes import MESH_ORDER, MeshAxis, expert_groups, mesh_coords, mesh_rank
from .inventory import local_tensors
from .models import ModelSpec
from .plan import Plan


def rank_classes(spec: ModelSpec, plan: Plan) -> dict[int, int]:
    """rank -> the representative (lowest rank) of its class: same pipeline coordinate, same
    sizes of every tensor it holds (plan.inventory.local_tensors); under ring CP the same cp
    coordinate too (a ring's sends go to the next rank, which `move` cannot translate)."""
    sizes: dict[tuple[int, int, int], tuple] = {}
    reps: dict[tuple, int] = {}
    out = {}
    for rank in range(plan.world_size):
        c = mesh_coords(rank, plan.mesh_shape)
        where = (c[MeshAxis.PP], c[MeshAxis.FSDP], c[MeshAxis.CP]) if plan.fsdp > 1 else (c[MeshAxis.PP], 0, 0)
        if where not in sizes:
            sizes[where] = tuple((held, storage) for _, held, storage in local_tensors(spec, plan, rank))
        ring = c[MeshAxis.CP] if plan.cp > 1 and plan.cp_method == "ring" else 0
        out[rank] = reps.setdefault((where[0], ring, sizes[where]), rank)
    return out


def move(group: list[int], rep: int, target: int, plan: Plan) -> list[int]:
    """The group that is to `target` what `group` is to `rep`: along the axes on which the
    group's members differ (its mesh axes) the members keep their coordinates; on every other
    axis they take target's. A pair [rep, peer] moves a send or recv's peer. An expert group
    (plan.axes.expert_groups: an ep group, a run of data-parallel ranks that need not span a
    whole axis, or a replica group) moves to target's group of the same kind."""
    shape = plan.mesh_shape
    if plan.ep > 1 and len(group) > 1:
        kinds = _expert_groups(tuple(shape.items()), plan.ep)
        for kind in kinds:
            if tuple(group) in kind:
                return list(kind[target])
    coords = [mesh_coords(m, shape) for m in group]
    own, mine = mesh_coords(rep, shape), mesh_coords(target, shape)
    along = {a for c in coords for a in MESH_ORDER if c[a] != own[a]}
    return [mesh_rank({a: c[a] if a in along else mine[a] for a in MESH_ORDER}, shape) for c in coords]


@functools.lru_cache(maxsize=8)
def _expert_groups(shape: tuple, ep: int) -> tuple[dict[tuple[int, ...], tuple[int, ...]], ...]:
    """For the ep groups and the replica groups: {each group, and each rank: its group}."""
    out = []
    for groups in expert_groups(dict(shape), ep):
        kind: dict = {}
        for g in groups:
            kind[tuple(g)] = tuple(g)
            kind.update({r: tuple(g) for r in g})
        out.append(kind)
    return tuple(out)


@dataclass
class Simulated:
    """What one simulated rank recorded."""

    memory: MemoryRecord
    comms: list[CommRecord]
    shards: list[ShardRecord]
    placements: dict[str, Any]
    """param -> how its DTensor is placed, for `DryRun.mover` (the simulator's own form)."""
    step: StepRecord
    seconds: float
    findings: list[LintFinding] = field(default_factory=list)
    """What the layout lint (runtime.layout.lint) found in the simulated rank's layout."""


@dataclass
class DryRun:
    """The records of a plan laid over `world` virtual ranks, as a live session would hold them.

    memory(): a MemoryRecord per rank; comms(ranks): the CommRecords of one training step;
    layout(rank=..., param=...): ShardRecords of a rank, or of one parameter on every rank;
    explain_comms(rank=None): the comms grouped by their cause (CommNodes).
    Records of ranks that were not simulated are their class representative's, moved.
    """

    spec: ModelSpec
    plan: Plan
    classes: dict[int, int]
    """rank -> the simulated rank whose records it shares (moved to it)."""
    simulated: dict[int, Simulated] = field(repr=False)
    mover: Callable[[Simulated, int, Plan], list[ShardRecord]] | None = field(default=None, repr=False)
    """(a representative's records, another rank of its class, the plan) -> that rank's ShardRecords:
    the simulator's (torch computes the index ranges of a rank's coordinates)."""
    seconds: float = 0.0
    """Wall time of the whole dry run."""

    @property
    def world(self) -> int:
        return self.plan.world_size

    @property
    def representatives(self) -> list[int]:
        return sorted(self.simulated)

    def __repr__(self) -> str:
        return (f"<DryRun {self.spec.name} {self.plan.describe()} on {self.world} virtual ranks: "
                f"{len(self.simulated)} simulated, {self.seconds:.1f} s>")

    def memory(self) -> RecordList:
        """One MemoryRecord per rank, rank order (as Session.memory(); rss is 0: nothing ran)."""
        return RecordList([replace(self.simulated[self.classes[r]].memory, rank=r) for r in range(self.world)],
                          columns=("rank", "step", "params", "grads", "optimizer", "activations"))

    def iter_comms(self, ranks: Iterable[int] | None = None) -> Iterator[CommRecord]:
        """The CommRecords of one step of each of `ranks` (None: every rank), generated one by one."""
        for r in range(self.world) if ranks is None else ranks:
            rep = self.classes[r]
            for c in self.simulated[rep].comms:
                yield c if r == rep else replace(
                    c, rank=r, group=move(c.group, rep, r, self.plan),
                    peer=None if c.peer is None else move([rep, c.peer], rep, r, self.plan)[1])

    def comms(self, ranks: Iterable[int] | int | None = None) -> RecordList:
        """CommRecords of one step of a rank, of several, or (None) of every rank."""
        return RecordList(self.iter_comms([ranks] if isinstance(ranks, int) else ranks))

    def explain_comms(self, rank: int | None = None) -> RecordList:
        """One step's collectives as a tree of their causes (records.comm_tree: module -> op that
        needed it -> collective, with count, bytes and axis; implicit redistributes counted), as
        Session.explain_comms gives a live step's: summed over every rank (each class's
        representative counted once per rank of its class, so a 1,024-rank mesh costs what its
        few simulated ranks do), or `rank`'s alone."""
        if rank is not None:
            if not 0 <= rank < self.world:
                raise ValueError(f"rank {rank} is outside the mesh of {self.world} ranks")
            return comm_tree(self.comms(rank), rank=rank)
        weights: dict[int, int] = {}
        for rep in self.classes.values():
            weights[rep] = weights.get(rep, 0) + 1
        return comm_tree((c for rep in self.representatives for c in self.simulated[rep].comms), weights=weights)

    def layout(self, rank: int | None = None, param: str | None = None) -> RecordList:
        """ShardRecords: every parameter `rank` holds, or `param` on every rank holding it."""
        if rank is None and param is None:
            raise ValueError("layout() needs rank= or param=")
        ranks = [rank] if rank is not None else range(self.world)
        out = []
        for r in ranks:
            if not 0 <= r < self.world:
                raise ValueError(f"rank {r} is outside the mesh of {self.world} ranks")
            out += [s for s in self._shards(r) if param is None or s.param == param]
        if param is not None and not out:
            known = self.parameters()
            raise KeyError(f"no rank holds {param!r}; parameters: {', '.join(known[:6])}, ...")
        return RecordList(out)

    def _shards(self, rank: int) -> list[ShardRecord]:
        rep = self.classes[rank]
        sim = self.simulated[rep]
        if rank == rep:
            return sim.shards
        if self.mover is None:
            raise ValueError(f"rank {rank} was not simulated, and this DryRun has no way to move its class's layout")
        return self.mover(sim, rank, self.plan)

    def parameters(self) -> list[str]:
        """Every parameter some rank holds, by name."""
        return sorted({s.param for sim in self.simulated.values() for s in sim.shards})

    def lint(self) -> RecordList:
        """The layout lint's findings on every rank of the virtual mesh (Session.check_layout's
        records): each representative's, listed for every rank of its class."""
        per_rank = (replace(f, ranks=[r]) for r in range(self.world) for f in self.simulated[self.classes[r]].findings)
        return RecordList(merged(per_rank), columns=LINT_COLUMNS)

    def steps(self) -> RecordList:
        """The StepRecord of each simulated rank (loss NaN: there are no values)."""
        return RecordList([self.simulated[r].step for r in self.representatives])
