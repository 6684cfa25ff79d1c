"""The "why" tree (records/comm_tree.py, viz/comm_tree.py, Session.explain_comms,
DryRun.explain_comms) on hand-built CommRecords: counts, bytes, the implicit mark, one rank's
tree against every rank's, and the tree's totals against the flat records'. Its live check rides
conftest.parity_steps (tests/test_dryrun.py); its panel check, the widget tests' sessions."""
from __future__ import annotations

import collections

import plotly.graph_objects as go
import pytest

from interactive_parallel.cluster.session_debugging import SessionDebugging
from interactive_parallel.cluster.telemetry import Telemetry
from interactive_parallel.records import CommNode, CommRecord, StepRecord, comm_tree, from_dict
from interactive_parallel.viz import comm_tree_figure, figures_from_records

pytestmark = pytest.mark.pure
ATTN, MLP = "model.layers.0.self_attn", "model.layers.0.mlp"


def tp2_sp_step(step: int = 0) -> list[CommRecord]:
    """Two tp ranks' step under sequence parallel, as causes.py names it: each block's input
    gathered (explicit, by the TP style), a norm's Partial gradient all-reduced by the optimizer's
    ops (implicit), a data-parallel bucket, and an untraced all-reduce."""
    out = []
    for r in (0, 1):
        def c(op, nbytes, module="", needed_by="", placements="", implicit=None, phase="", axis="tp"):
            return CommRecord(rank=r, step=step, op=op, bytes=nbytes, axis=axis, group=[0, 1], module=module,
                              needed_by=needed_by, placements=placements, implicit=implicit, phase=phase)
        out += [c("all_gather", 1024, ATTN, "redistribute", "S(1) -> R on tp", False, "forward"),
                c("all_gather", 1024, MLP, "redistribute", "S(1) -> R on tp", False, "forward"),
                c("reduce_scatter", 2048, MLP + ".down_proj", "redistribute", "P(sum) -> S(1) on tp", False, "forward"),
                c("all_reduce", 256, needed_by="aten.lerp_", placements="P(sum) -> R on tp", implicit=True,
                  phase="optimizer"),
                c("all_reduce", 256, needed_by="aten.addcmul_", placements="P(sum) -> R on tp", implicit=True,
                  phase="optimizer"),
                c("all_reduce", 256, needed_by="aten.addcmul_", placements="P(sum) -> R on tp", implicit=True,
                  phase="optimizer"),
                c("all_reduce", 4096, "ddp bucket 0", "bucket all-reduce", phase="backward", axis="dp"),
                c("all_reduce", 8, axis="")]
    return out


def by_path(tree) -> dict[str, CommNode]:
    return {n.path: n for n in tree}


def test_the_tree_groups_by_module_then_op_then_collective():
    tree = comm_tree(tp2_sp_step())
    nodes = by_path(tree)
    attn = nodes[ATTN]
    assert (attn.depth, attn.count, attn.bytes, attn.axis, attn.phase, attn.ranks, attn.rank) == \
        (0, 2, 2048, "tp", "forward", 2, None)
    leaf = nodes[f"{ATTN} / redistribute / all_gather S(1) -> R on tp"]
    assert (leaf.depth, leaf.op, leaf.needed_by, leaf.placements, leaf.count, leaf.bytes, leaf.implicit) == \
        (2, "all_gather", "redistribute", "S(1) -> R on tp", 2, 2048, 0)
    assert [n.tree for n in tree[:3]] == ["ddp bucket 0", "  bucket all-reduce", "    all_reduce on dp"]
    # depth first, each node right above its children, siblings largest first
    for i, n in enumerate(tree):
        if n.depth:
            parent = next(p for p in reversed(tree[:i]) if p.depth == n.depth - 1)
            assert n.parent == parent.path and n.path.startswith(parent.path)
    tops = [n.bytes for n in tree if n.depth == 0]
    assert tops == sorted(tops, reverse=True)
    assert nodes["(untraced)"].count == 2 and nodes["(untraced) / (untraced) / all_reduce on world"].bytes == 16


def test_implicit_redistributes_are_marked_and_counted_up_the_tree():
    nodes = by_path(comm_tree(tp2_sp_step()))
    outside = nodes["(outside any module)"]
    assert (outside.count, outside.implicit, outside.bytes, outside.phase) == (6, 6, 6 * 256, "optimizer")
    lerp, addcmul = nodes["(outside any module) / aten.lerp_"], nodes["(outside any module) / aten.addcmul_"]
    assert (lerp.implicit, addcmul.implicit) == (2, 4) and addcmul.bytes > lerp.bytes  # the larger first
    leaf = nodes["(outside any module) / aten.addcmul_ / all_reduce P(sum) -> R on tp (implicit)"]
    assert leaf.implicit == leaf.count == 4
    assert all(n.implicit == 0 for n in nodes.values() if not n.path.startswith("(outside"))


def test_the_trees_totals_equal_the_flat_records_summed_or_per_rank():
    comms = tp2_sp_step(0) + tp2_sp_step(1)
    for rank in (None, 0, 1):
        mine = [c for c in comms if rank is None or c.rank == rank]
        tree = comm_tree(comms, rank=rank)
        for depth in (0, 1, 2):
            level = [n for n in tree if n.depth == depth]
            assert sum(n.count for n in level) == len(mine) and sum(n.bytes for n in level) == sum(c.bytes for c in mine)
            assert sum(n.implicit for n in level) == sum(bool(c.implicit) for c in mine)
        assert all(n.rank == rank and n.ranks == (2 if rank is None else 1) for n in tree)
    one = {(n.path, n.count, n.bytes) for n in comm_tree(comms, rank=0)}
    every = {(n.path, n.count // 2, n.bytes // 2) for n in comm_tree(comms)}
    assert one == every  # the two ranks issued the same collectives


def test_a_representative_weighted_counts_for_its_class_and_rows_round_trip():
    comms = [c for c in tp2_sp_step() if c.rank == 0]
    weighted = comm_tree(comms, weights={0: 512})
    assert [(n.path, n.count, n.bytes) for n in weighted] == \
        [(n.path, 512 * n.count, 512 * n.bytes) for n in comm_tree(comms)]
    assert weighted[0].ranks == 512
    assert all(from_dict(n.to_dict()) == n for n in weighted)
    assert "tree" in str(weighted).splitlines()[0] and "  redistribute" in str(weighted)
    assert comm_tree([]) == []


def test_the_treemap_sizes_by_bytes_and_colours_implicit_ones():
    fig = comm_tree_figure(tp2_sp_step())
    (trace,) = fig.data
    assert isinstance(trace, go.Treemap) and trace.branchvalues == "total"
    tree = comm_tree(tp2_sp_step())
    assert list(trace.ids) == ["all collectives"] + [n.path for n in tree]
    assert trace.values[0] == sum(c.bytes for c in tp2_sp_step()) and list(trace.values[1:]) == [n.bytes for n in tree]
    colours = dict(zip(trace.ids, trace.marker.colors))
    implicit = [n.path for n in tree if n.depth == 2 and n.implicit]
    assert implicit and {colours[p] for p in implicit} == {"#d62728"}
    assert "#d62728" not in {colours[n.path] for n in tree if not n.implicit}
    assert "6 implicit" in fig.layout.title.text
    hover = dict(zip(trace.ids, trace.hovertext))[f"{ATTN} / redistribute / all_gather S(1) -> R on tp"]
    assert "2 collectives" in hover and "S(1) -> R on tp" in hover and "forward" in hover
    assert comm_tree_figure(list(tree)).data[0].ids == trace.ids  # drawn from explain_comms' rows alike
    assert "rank 1" in comm_tree_figure(tp2_sp_step(), rank=1).layout.title.text
    assert not comm_tree_figure(None).data
    zero = comm_tree_figure([CommRecord(rank=0, step=0, op="barrier", bytes=0)])
    assert zero.data[0].values[0] == 1 and "sized by count" in zero.layout.title.text


def test_the_report_draws_the_latest_steps_tree():
    figs = figures_from_records(tp2_sp_step(0) + tp2_sp_step(1)[:1])
    assert figs["comm_tree"].data[0].values[0] == 1024  # step 1's one gather


class _Holder(SessionDebugging):
    world_size = 2

    def __init__(self):
        self.telemetry = Telemetry()


def test_session_explain_comms_reads_the_telemetry_and_refuses_a_rank_outside():
    s = _Holder()
    for step in (0, 1):
        s.telemetry.add_step([StepRecord(rank=r, step=step, loss=1.0, tokens=1, time_s=0.1,
                                         comms=[c for c in tp2_sp_step(step) if c.rank == r]) for r in (0, 1)])
    latest = s.explain_comms()
    assert latest == comm_tree(tp2_sp_step(1)) and s.explain_comms(rank=1) == comm_tree(tp2_sp_step(1), rank=1)
    assert collections.Counter(n.count for n in s.explain_comms(steps=2)) == \
        collections.Counter(2 * n.count for n in latest)
    with pytest.raises(ValueError, match=r"ranks are 0\.\.1 \(world size 2\)"):
        s.explain_comms(rank=2)
