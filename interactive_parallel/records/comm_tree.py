"""Why a step's collectives happened, as a tree: CommRecords grouped by the module that issued
them, then the op that needed them, then the collective itself (op, mesh axis, placements).

Owns the grouping (`comm_tree`) and its row (`CommNode`): one row per node, depth first, each
with the count and bytes of the collectives under it, so the tree prints as a table, feeds a
treemap (viz/comm_tree.py) and sums to the flat records it was made from. A pure grouping of
records already collected: it costs nothing per step and asks no rank. Knows nothing of how a
cause was read (runtime/probes/causes.py), nor of torch, ipyparallel or plotly.

Conventions: bytes are each issuing rank's own (`CommRecord.bytes`, full buffer), summed; a send
and its receive each count on their rank (viz.comm_breakdown counts such a transfer once), so
the tree's count and bytes equal `len(records)` and `sum(r.bytes)` of what it was given.
Summed over ranks by default; `rank=` keeps one rank's (the per-rank view).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from .base import Record, RecordList
from .training import CommRecord

SEP = " / "
"""Between the labels of a node's path (no module path, op or placement contains it)."""
UNTRACED = "(untraced)"
"""Module and op of a record without a cause (tracing off: `probes.set_tracing(False)`)."""
OUTSIDE = "(outside any module)"
"""Module of a record issued outside every module (loss_parallel's cross entropy, a step's own call)."""
UNNAMED = "(unnamed)"
"""Op of a record whose module is known but not the op (a frame causes.py does not know)."""
PHASES = ("forward", "backward", "optimizer")
COLUMNS = ("tree", "count", "bytes", "axis", "placements", "implicit", "phase", "ranks")
"""The columns a tree prints with: its labels indented by depth, then the numbers."""


@dataclass
class CommNode(Record):
    """One node of the "why" tree: a module (depth 0), an op that needed collectives inside it
    (depth 1) or one kind of collective that op needed (depth 2), with what is under it."""

    kind: ClassVar[str] = "comm_node"
    path: str
    """The labels from the module down to this node, joined by ' / ': unique in its tree, and a
    child's path starts with its parent's."""
    depth: int
    """0: module (or wrapper unit: `fsdp unit model.layers.3`, `ddp bucket 0`); 1: the op that
    needed it (`aten.mm`, `redistribute`, `unshard`); 2: the collective (op, axis, placements)."""
    module: str
    needed_by: str = ""
    """The op of a depth 1 or 2 node ('' at depth 0)."""
    op: str = ""
    """The collective of a depth 2 node (all_reduce, all_gather, send, ...); '' above."""
    axis: str = ""
    """The mesh axis of a depth 2 node ('world' for the default group); above, every axis of the
    collectives under the node, comma-separated."""
    placements: str = ""
    """A redistribute's placements before and after (`S(1) -> R on tp`), depth 2 only."""
    count: int = 0
    """Collectives under this node (summed over ranks unless the tree is one rank's)."""
    bytes: int = 0
    """Their bytes, each issuing rank's own, summed."""
    implicit: int = 0
    """Of `count`, how many were implicit redistributes: DTensor's sharding propagation chose
    them, at this op, because an input's placement did not fit it."""
    phase: str = ""
    """forward, backward, optimizer: the phases its collectives were issued in, comma-separated."""
    ranks: int = 0
    """How many ranks issued collectives under this node."""
    rank: int | None = None
    """The rank of a one-rank tree; None when summed over ranks."""

    @property
    def label(self) -> str:
        """The node's own name (its path's last part)."""
        return self.path.rsplit(SEP, 1)[-1]

    @property
    def parent(self) -> str:
        """The path of the node above ('' for a module)."""
        return self.path.rsplit(SEP, 1)[0] if self.depth else ""

    @property
    def tree(self) -> str:
        """The label indented by depth: the column a printed tree reads by."""
        return "  " * self.depth + self.label


def _causes(c: CommRecord) -> tuple[str, str]:
    if not c.module and not c.needed_by:
        return UNTRACED, UNTRACED
    return c.module or OUTSIDE, c.needed_by or UNNAMED


def comm_tree(comms: Iterable[CommRecord], rank: int | None = None,
              weights: Mapping[int, int] | None = None) -> RecordList:
    """CommNodes of `comms` depth first: each module, then the ops inside it that needed
    collectives, then each kind of collective each op needed; siblings by bytes, largest first
    (ties: the first issued first). `rank`: that rank's records alone (each node's `rank` says
    so); None sums every rank's. `weights`: rank -> how many ranks each of its records stands
    for (a dry run's class representative), 1 when absent."""
    nodes: dict[tuple, dict] = {}
    children: dict[tuple, list[tuple]] = {}
    for i, c in enumerate(comms):
        if rank is not None and c.rank != rank:
            continue
        n = 1 if weights is None else weights.get(c.rank, 1)
        module, needed_by = _causes(c)
        leaf = (module, needed_by, c.op, c.axis or "world", c.placements, bool(c.implicit))
        above: tuple = ()
        for key in (leaf[:1], leaf[:2], leaf):
            if key not in nodes:
                nodes[key] = dict(first=i, count=0, bytes=0, implicit=0, axes={}, phases=set(), ranks={})
                children.setdefault(above, []).append(key)
            acc, above = nodes[key], key
            acc["count"] += n
            acc["bytes"] += n * c.bytes
            acc["implicit"] += n if c.implicit else 0
            acc["axes"][c.axis or "world"] = None  # a dict: the axes in the order first seen
            acc["phases"].add(c.phase)
            acc["ranks"][c.rank] = n
    rows: list[CommNode] = []
    _emit(nodes, children, (), rows, rank)
    return RecordList(rows, columns=COLUMNS)


def _emit(nodes: dict[tuple, dict], children: dict[tuple, list[tuple]], above: tuple, rows: list[CommNode],
          rank: int | None) -> None:
    """Append the nodes under `above` (each followed by its own) to `rows`, largest first."""
    largest = lambda k: (-nodes[k]["bytes"], -nodes[k]["count"], nodes[k]["first"])  # noqa: E731
    for key in sorted(children.get(above, ()), key=largest):
        rows.append(_node(key, nodes[key], rank))
        _emit(nodes, children, key, rows, rank)


def _node(key: tuple, acc: dict, rank: int | None) -> CommNode:
    module, needed_by = key[0], key[1] if len(key) > 1 else ""
    leaf = len(key) == 6
    op, axis, placements, implicit = key[2:] if leaf else ("", "", "", False)
    labels = [module, needed_by] if needed_by else [module]
    if leaf:
        labels.append(f"{op} {placements or 'on ' + axis}" + (" (implicit)" if implicit else ""))
    phases = acc["phases"] - {""}
    return CommNode(path=SEP.join(labels), depth=len(labels) - 1, module=module, needed_by=needed_by, op=op,
                    axis=axis if leaf else ", ".join(acc["axes"]), placements=placements, count=acc["count"],
                    bytes=acc["bytes"], implicit=acc["implicit"],
                    phase=", ".join([p for p in PHASES if p in phases] + sorted(phases - set(PHASES))),
                    ranks=sum(acc["ranks"].values()), rank=rank)
