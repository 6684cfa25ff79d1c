"""viz/mesh.py: the device mesh folded into a grid, its hover text and its communication links,
from hand-made records (pure) and from a dry run's records (rank1)."""
from __future__ import annotations

import math

import pytest

from interactive_parallel import Plan
from interactive_parallel.records import CommRecord, MemoryRecord, ShardRecord
from interactive_parallel.viz import comm_links, mesh_figure, mesh_grid

GiB = 1024 ** 3


@pytest.mark.pure
@pytest.mark.parametrize("plan,rows,cols", [
    (Plan(dp=2, tp=2), (), ("dp", "tp")),
    (Plan(pp=8, dp=16, tp=8), ("dp",), ("pp", "tp")),
    (Plan(fsdp=4, cp=2, tp=2), ("fsdp",), ("cp", "tp")),
    (Plan(pp=2, dp=2, fsdp=2, cp=2, tp=2), ("pp", "fsdp"), ("dp", "cp", "tp")),
])
def test_any_number_of_axes_folds_into_a_grid_with_one_cell_per_rank(plan, rows, cols):
    grid = mesh_grid(plan)
    assert (grid.row_axes, grid.col_axes) == (rows, cols)
    cells = {grid.cell(r) for r in range(plan.world_size)}
    assert len(cells) == plan.world_size == grid.rows * grid.cols
    # neighbouring tp ranks sit side by side in a row
    assert grid.cell(1) == (grid.cell(0)[0], grid.cell(0)[1] + 1)


@pytest.mark.pure
def test_grid_coordinates_are_the_runtimes():
    grid = mesh_grid({"pp": 2, "dp": 2, "tp": 2})
    assert grid.coords(5) == {"pp": 1, "dp": 0, "tp": 1}
    with pytest.raises(ValueError, match="unknown mesh axes"):
        mesh_grid({"ep": 2})


def _records():
    """dp(2) x tp(2): a tp all-reduce per rank (100 B), a dp all-reduce (1000 B), a send 0 -> 2."""
    comms = [CommRecord(rank=r, step=0, op="all_reduce", bytes=100, axis="tp", group=[r - r % 2, r - r % 2 + 1])
             for r in range(4)]
    comms += [CommRecord(rank=r, step=0, op="all_reduce", bytes=1000, axis="dp", group=[r % 2, r % 2 + 2])
              for r in range(4)]
    comms += [CommRecord(rank=0, step=0, op="send", bytes=7, axis="dp", peer=2),
              CommRecord(rank=2, step=0, op="recv", bytes=7, axis="dp", peer=0)]
    memory = [MemoryRecord(rank=r, step=0, params=GiB, grads=GiB, optimizer=2 * GiB, activations=r * GiB)
              for r in range(4)]
    shards = [ShardRecord(param="w", rank=r, global_shape=[8, 4], local_shape=[4, 4], placements=["Replicate()",
              "Shard(dim=0)"], mesh_axes=["dp", "tp"], coords={"dp": r // 2, "tp": r % 2},
              index=[[4 * (r % 2), 4 * (r % 2) + 4], [0, 4]]) for r in range(4)]
    return comms, memory, shards


@pytest.mark.pure
def test_links_sum_the_bytes_each_group_issued():
    comms, _, _ = _records()
    links = comm_links(iter(comms))  # any iterable: a dry run streams them
    assert links["tp"] == {(0, 1): 200, (2, 3): 200}
    assert links["dp"] == {(0, 2): 2000 + 7, (1, 3): 2000}  # the recv counted through its send


@pytest.mark.pure
def test_figure_colours_by_memory_and_hovers_holdings_and_both_memories():
    comms, memory, shards = _records()
    predicted = [MemoryRecord(rank=r, step=-1, params=GiB, grads=GiB, optimizer=2 * GiB, activations=GiB)
                 for r in range(4)]
    fig = mesh_figure(Plan(dp=2, tp=2), memory=memory, predicted=predicted, shards=shards, param="w",
                      comms=comms, source="dry run")
    heat = fig.data[0]
    grid = mesh_grid(Plan(dp=2, tp=2))
    row, col = grid.cell(3)
    assert math.isclose(heat.z[row][col], 4 + 3)  # measured GiB of rank 3 (GiB: the largest is 7)
    text = heat.customdata[row][col]
    assert "rank 3: dp1 tp1" in text and "w (8, 4): [4:8, 0:4]" in text
    assert "predicted: 5 GiB" in text and "measured: 7 GiB" in text
    assert "dry run" in fig.layout.title.text and "4 ranks" in fig.layout.title.text
    lines = {t.name.split(":")[0]: t for t in fig.data[1:]}
    assert set(lines) == {"tp", "dp"}
    assert lines["dp"].line.width > lines["tp"].line.width  # more bytes per rank, a thicker link


@pytest.mark.pure
def test_one_rank_has_no_mesh():
    assert "no mesh" in mesh_figure(Plan()).layout.annotations[0].text


@pytest.mark.rank1
def test_mesh_of_a_dry_run_of_a_thousand_ranks():
    from interactive_parallel import dry_run

    d = dry_run("tiny-llama", Plan(dp=64, pp=4, tp=4, batch_size=256, seq_len=32))
    fig = mesh_figure(d.plan, memory=d.memory(), shards=d.layout(param="lm_head.weight"),
                      param="lm_head.weight", comms=d.iter_comms(), source="dry run")
    cells = sum(1 for row in fig.data[0].z for v in row if v is not None)
    assert cells == 1024
    axes = {t.name.split(":")[0] for t in fig.data[1:]}
    assert {"tp", "dp", "pp"} <= axes


@pytest.mark.pure
def test_under_ep_each_cell_names_the_experts_its_rank_holds():
    plan = Plan(dp=2, fsdp=2, tp=2, ep=4)
    fig = mesh_figure(plan, num_experts=8)
    heat = fig.data[0]
    cells = {t.split("<br>")[0]: t for row in heat.text for t in row if t}
    # ep rides on the data-parallel ranks (dp, fsdp): tp neighbours hold the same experts
    assert cells["0"].endswith("E0-1") and cells["1"].endswith("E0-1") and cells["2"].endswith("E2-3")
    assert cells["6"].endswith("E6-7")
    hovers = [h for row in heat.customdata for h in row]
    assert sum("holds experts 0..1" in h for h in hovers) == 2
    assert not any("E0" in t for row in mesh_figure(Plan(dp=2, fsdp=2, tp=2), num_experts=8).data[0].text
                   for t in row if t)


@pytest.mark.pure
def test_under_pp_each_cell_names_its_stages_and_their_layers():
    plan = Plan(pp=4, dp=2)  # 10 layers on 4 stages: 2, 3, 3, 2 (the ends also embed / hold the head)
    heat = mesh_figure(plan, num_layers=10).data[0]
    cells = {t.split("<br>")[0]: t for row in heat.text for t in row if t}
    assert cells["0"].endswith("S0:L0-1") and cells["2"].endswith("S1:L2-4") and cells["7"].endswith("S3:L8-9")
    hovers = [h for row in heat.customdata for h in row]
    assert sum("stage 1: 3 layers (L2-4)" in h for h in hovers) == 2
    assert sum("stage 3: 2 layers (L8-9 + norm, head)" in h for h in hovers) == 2
    v = mesh_figure(Plan(pp=2, pp_schedule="zbv", microbatches=4), num_layers=8).data[0]
    texts = {t.split("<br>")[0]: t for row in v.text for t in row if t}
    assert texts["0"].endswith("S0:L0-1 S3:L6-7") and texts["1"].endswith("S1:L2-3 S2:L4-5")
    assert not any("S0" in t for row in mesh_figure(Plan(dp=2, tp=2), num_layers=8).data[0].text for t in row if t)


@pytest.mark.pure
def test_a_large_mesh_draws_and_counts_the_groups_of_the_focus_rank_only():
    """Beyond ALL_LINKS ranks the figure links rank `focus`'s groups, and its legend's bytes per
    rank are that rank's own: not the mean over every rank's groups."""
    plan = Plan(dp=64, tp=2)  # 128 ranks; tp pairs (0, 1), (2, 3), ...
    comms = [CommRecord(rank=r, step=0, op="all_reduce", axis="tp", group=[r - r % 2, r - r % 2 + 1],
                        bytes=1000 if r < 2 else 10, dtype="float32", start=1.0, end=2.0) for r in range(128)]
    fig = mesh_figure(plan, comms=comms, focus=0)
    (tp,) = [t for t in fig.data[1:] if t.name.startswith("tp:")]
    assert tp.name == "tp: 1000 B/rank", tp.name  # rank 0's pair issued 1000 B each, the others 10
    assert sum(x is None for x in tp.x) == 1  # one arc: rank 0's pair only
    fig = mesh_figure(plan, comms=comms, focus=2)
    assert [t.name for t in fig.data[1:] if t.name.startswith("tp:")] == ["tp: 10 B/rank"]
