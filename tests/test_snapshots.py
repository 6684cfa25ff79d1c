"""Recovery snapshots on disk, without ranks: which ranks write one, when a generation counts.

- Data-parallel replicas share the writing: every key written once, the bytes balanced, the
  same split on every replica whatever order its state lists the keys in.
- A generation counts once rank 0 has named its plan and writers and every writer's directory
  is in place with DCP's metadata: a writer still writing (only its partial directory), a
  missing writer or a missing plan file leave the previous generation the newest.
- Going back to a step drops the generations after it.
- A rank counts the bytes of its own directory, never a peer's still moving into place.
"""
from __future__ import annotations

import json
import os

import pytest

from interactive_parallel.plan import Plan
from interactive_parallel.runtime.checkpoints import checkpoint as ck

pytestmark = pytest.mark.pure

@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_replicas_share_the_writing_by_bytes(count):
    import torch

    state = {f"model.w{i}": torch.zeros(64 * (i % 5 + 1)) for i in range(23)}
    state["train.step"] = 7
    shares = ck.replica_share(state, count)
    assert shares == ck.replica_share(dict(reversed(list(state.items()))), count)  # same on every replica
    keys = [k for share in shares for k in share if k != "train.step"]
    assert sorted(keys) == sorted(k for k in state if k != "train.step")  # every key once
    assert all("train.step" in share for share in shares)  # no share is empty
    loads = [sum(state[k].numel() for k in share if k != "train.step") for share in shares]
    assert max(loads) - min(loads) <= 64 * 5  # within the largest tensor


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


def test_a_rank_counts_the_bytes_it_wrote_not_a_peers_still_moving(tmp_path):
    """take_snapshot's size: this rank's directory only. A peer's partial directory is renamed
    while it is read (a fresh clone's CI once failed on a file gone between listing and sizing)."""
    path = tmp_path / "step-000000003"
    mine, peer = path / "rank-00000", path / "rank-00001.partial-abc"
    for d, n in ((mine, 100), (peer, 7)):
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x" * n)
    (mine / ".metadata").write_bytes(b"m" * 10)
    assert ck.written_bytes(str(path)) == 110  # without a process group this is rank 0
