"""Recovery snapshots on disk, without ranks: which ranks write one, when a generation counts.

- The writers rank 0 names for a plan are the ranks of data-parallel coordinate 0, the same
  ranks every reader is sent to (checkpoint._replica_source computes the rank from its own
  coordinates with _mesh_rank), for every plan of the parity tests.
- A generation counts once rank 0 has named its plan and writers and every writer's directory
  is in place with DCP's metadata: a writer still writing (only its partial directory), a
  missing writer or a missing plan file leave the previous generation the newest.
- Going back to a step drops the generations after it.
"""
from __future__ import annotations

import itertools
import json
import os

import pytest

from interactive_parallel.plan import MESH_ORDER, MeshAxis, Plan
from interactive_parallel.runtime import checkpoint as ck

pytestmark = pytest.mark.pure

PLANS = [dict(dp=4), dict(fsdp=4), dict(dp=2, tp=2), dict(pp=2, dp=2), dict(dp=2, fsdp=2), dict(dp=2, pp=2, tp=2),
         dict(dp=2, cp=2, tp=2), dict(tp=4)]


@pytest.mark.parametrize("fields", PLANS, ids=str)
def test_writers_are_the_first_replicas_ranks(fields):
    plan = Plan(**fields)
    shape = plan.mesh_shape
    sources = set()
    for coords in itertools.product(*[range(shape[a]) for a in MESH_ORDER]):
        c = dict(zip(MESH_ORDER, coords), **{MeshAxis.DP: 0})
        sources.add(ck._mesh_rank(c, shape))
    world = 1
    for v in shape.values():
        world *= v
    assert ck._writers(plan, world) == sorted(sources)
    assert ck._writers(plan, world + 1) == list(range(world + 1))  # not the plan's mesh: everyone


def _generation(folder, step, writers, done, plan=True):
    path = os.path.join(folder, f"{ck.SNAPSHOT_PREFIX}{step:09d}")
    os.makedirs(path, exist_ok=True)
    if plan:
        with open(os.path.join(path, ck.PLAN_FILE), "w") as f:
            json.dump({"plan": Plan(dp=2, tp=2).to_dict(), "writers": writers}, f)
    for r in writers:
        final = ck._rank_dir(path, r)
        os.makedirs(final + ".partial-abc" if r not in done else final, exist_ok=True)
        if r in done:
            open(os.path.join(final, ".metadata"), "w").close()
    return path


def test_a_generation_counts_once_every_writer_is_in_place(tmp_path):
    folder = str(tmp_path)
    first = _generation(folder, 20, [0, 1], done=[0, 1])
    _generation(folder, 40, [0, 1], done=[0])  # rank 1 still writing
    assert ck.latest_snapshot(folder) == first
    _generation(folder, 60, [0, 1], done=[0, 1], plan=False)  # rank 0 has not named it
    assert ck.latest_snapshot(folder) == first
    later = _generation(folder, 40, [0, 1], done=[0, 1])
    assert ck.snapshot_dirs(folder) == [first, later]
    assert ck.snapshot_plan(later) == Plan(dp=2, tp=2)
    ck.drop_snapshots_after(folder, 20)
    assert sorted(os.listdir(folder)) == [os.path.basename(first)]
