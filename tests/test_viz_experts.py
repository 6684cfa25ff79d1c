"""viz/experts.py: expert load, tokens moved and imbalance from hand-made ExpertRecords
(2 ep ranks, 2 MoE layers, 4 experts: rank 0 holds experts 0-1, rank 1 experts 2-3, top_k 2)."""
from __future__ import annotations

import plotly.graph_objects as go
import pytest

from interactive_parallel.records import CommRecord, ExpertRecord, StepRecord, from_dict
from interactive_parallel.viz import (TITLE_CHARS, expert_load, expert_load_figure, expert_load_over_steps_figure,
                                      imbalance, tokens_moved, tokens_moved_figure)

pytestmark = pytest.mark.pure
HELD = {0: [0, 1], 1: [2, 3]}
ROUTED = {  # step -> layer -> rank -> pairs its tokens sent to each expert (4 tokens x top_k 2 = 8)
    0: {0: {0: [5, 1, 1, 1], 1: [3, 2, 2, 1]}, 1: {0: [2, 2, 2, 2], 1: [2, 2, 2, 2]}},
    1: {0: {0: [2, 2, 2, 2], 1: [1, 3, 2, 2]}, 1: {0: [0, 0, 4, 4], 1: [0, 0, 6, 2]}},
}


def make_experts(steps=(0, 1)) -> list[ExpertRecord]:
    """Consistent records: sent[j] = pairs to peer j's experts, received[j] = peer j's sent[me],
    tokens[e] = pairs every rank routed to e."""
    out = []
    for step in steps:
        for layer, by_rank in ROUTED[step].items():
            sent = {r: [sum(by_rank[r][e] for e in HELD[p]) for p in (0, 1)] for r in (0, 1)}
            for r in (0, 1):
                out.append(ExpertRecord(
                    rank=r, step=step, layer=layer, experts=HELD[r],
                    tokens=[sum(by_rank[q][e] for q in (0, 1)) for e in HELD[r]], routed=by_rank[r],
                    sent=sent[r], received=[sent[p][r] for p in (0, 1)], ep_group=[0, 1]))
    return out


def no_data(fig: go.Figure) -> bool:
    return len(fig.data) == 0 and any(a.text == "no mixture-of-experts records" for a in fig.layout.annotations)


def test_load_heatmap_sums_tokens_by_global_expert_of_the_latest_step():
    recs = make_experts()
    assert expert_load(recs) == {0: [3, 5, 4, 4], 1: [0, 0, 10, 6]}
    assert expert_load(recs, step=0) == {0: [8, 3, 3, 2], 1: [4, 4, 4, 4]}
    for by_layer in expert_load(recs, step=0).values():  # every layer: global tokens x top_k
        assert sum(by_layer) == 16
    fig = expert_load_figure(recs)
    (heat,) = fig.data
    assert [list(row) for row in heat.z] == [[3, 5, 4, 4], [0, 0, 10, 6]]
    assert list(heat.y) == ["layer 0", "layer 1"] and list(heat.x) == [f"expert {e}" for e in range(4)]
    title = fig.layout.title.text
    assert "step 1" in title and "2.50" in title and "layer 1" in title  # 10 / mean 4
    assert all(len(line) <= TITLE_CHARS for line in title.split("<br>"))
    assert [row[0] for row in heat.customdata] == [pytest.approx(1.25), pytest.approx(2.5)]
    assert list(expert_load_figure(recs, step=0).data[0].z[0]) == [8, 3, 3, 2]


def test_step_records_and_a_tp_duplicate_without_ep():
    recs = make_experts(steps=(0,))
    steps = [StepRecord(rank=r, step=0, loss=1.0, tokens=4, time_s=1.0, experts=[e for e in recs if e.rank == r])
             for r in (0, 1)]
    assert expert_load(steps) == expert_load(recs)
    # without ep: every rank holds every expert; a tp_rank 1 twin processed the same tokens again
    dense = [ExpertRecord(rank=r, step=0, layer=0, experts=[0, 1, 2, 3], tokens=[4, 2, 1, 1], routed=[4, 2, 1, 1],
                          ep_group=[r], tp_rank=r) for r in (0, 1)]
    assert expert_load(dense) == {0: [4, 2, 1, 1]}
    assert not tokens_moved(dense)
    assert "expert parallelism is off" in tokens_moved_figure(dense).layout.annotations[0].text


def test_imbalance_ratio():
    assert imbalance([4, 4, 4, 4]) == 1.0
    assert imbalance([8, 3, 3, 2]) == pytest.approx(2.0)
    assert imbalance({0: [3, 5, 4, 4], 1: [0, 0, 10, 6]}) == pytest.approx(2.5)  # the worst layer
    assert imbalance([0, 0]) == 1.0 and imbalance({}) == 1.0


def test_tokens_moved_matches_sent_and_the_peers_received():
    recs = make_experts()
    latest = [r for r in recs if r.step == 1]
    moved = tokens_moved(recs)
    for src in (0, 1):
        for dst in (0, 1):
            assert moved[(src, dst)] == sum(r.sent[dst] for r in latest if r.rank == src)
            # consistency: what src sent dst is what dst says it received from src
            assert moved[(src, dst)] == sum(r.received[src] for r in latest if r.rank == dst)
    assert moved == {(0, 0): 4, (0, 1): 12, (1, 0): 4, (1, 1): 12}
    assert tokens_moved(recs, layer=0) == {(0, 0): 4, (0, 1): 4, (1, 0): 4, (1, 1): 4}
    assert tokens_moved(recs, layer=0, step=0) == {(0, 0): 6, (0, 1): 2, (1, 0): 5, (1, 1): 3}
    fig = tokens_moved_figure(recs, layer=0, step=0)
    assert [list(row) for row in fig.data[0].z] == [[6, 2], [5, 3]]
    assert "7 pairs off-rank" in fig.layout.title.text and "layer 0" in fig.layout.title.text
    sized = tokens_moved_figure(recs, hidden_size=64, dtype_bytes=4)
    assert "4 KiB" in sized.layout.title.text  # 16 off-rank pairs x 64 x 4 B
    assert sized.data[0].customdata[0][1] == "3 KiB"  # 12 pairs x 256 B


def test_imbalance_over_steps():
    fig = expert_load_over_steps_figure(make_experts())
    assert [t.name for t in fig.data] == ["layer 0", "layer 1"]
    assert list(fig.data[0].x) == [0, 1]
    assert list(fig.data[0].y) == [pytest.approx(2.0), pytest.approx(1.25)]
    assert list(fig.data[1].y) == [pytest.approx(1.0), pytest.approx(2.5)]
    worst = expert_load_over_steps_figure(make_experts(), per_layer=False)
    assert [list(t.y) for t in worst.data] == [[pytest.approx(2.0), pytest.approx(2.5)]]


@pytest.mark.parametrize("func", [expert_load_figure, tokens_moved_figure, expert_load_over_steps_figure])
def test_empty_input_and_dicts(func):
    for empty in ([], None, [StepRecord(rank=0, step=0, loss=1.0, tokens=1, time_s=1.0)]):
        fig = func(empty)
        assert no_data(fig) and fig.layout.title.text
    assert expert_load(None) == {} and tokens_moved([]) == {}
    with pytest.raises(TypeError, match="from_dict"):
        func([r.to_dict() for r in make_experts()])
    with pytest.raises(TypeError, match="experts"):
        func([CommRecord(rank=0, step=0, op="all_reduce", bytes=1, dtype="float32")])
    assert func([from_dict(r.to_dict()) for r in make_experts()]).to_dict() == func(make_experts()).to_dict()


@pytest.mark.pure
def test_the_report_has_the_expert_figures_for_a_mixture_of_experts():
    from interactive_parallel.records import StepRecord
    from interactive_parallel.viz import figures_from_records

    experts = make_experts()
    steps = [StepRecord(rank=0, step=s, loss=1.0, tokens=8, time_s=0.1,
                        experts=[e for e in experts if e.step == s and e.rank == 0]) for s in (0, 1)]
    figs = figures_from_records(steps + [e for e in experts if e.rank != 0])
    assert {"expert_load", "expert_imbalance", "tokens_moved"} <= set(figs)
    assert "expert_load" not in figures_from_records([StepRecord(rank=0, step=0, loss=1.0, tokens=8, time_s=0.1)])
