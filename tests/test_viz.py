"""viz/: figures from hand-made records (4 ranks, 3 steps), checked by their traces and values."""
from __future__ import annotations

import math
import subprocess
import sys

import plotly.graph_objects as go
import pytest
from plotly.offline import get_plotlyjs

from interactive_parallel.records import CommRecord, MemoryRecord, PipelineEvent, ShardRecord, StepRecord, from_dict
from interactive_parallel.viz import (
    EMPTY_TEXT, bubble_fractions, comm_breakdown, comm_breakdown_figure, comm_matrix, comm_matrix_figure,
    figures_from_records, layout_table, loss_figure, memory_figure, pipeline_figure, shard_regions,
    sharding_figure, throughput_figure, timeline_figure, write_report)

pytestmark = pytest.mark.pure
MiB = 1024 ** 2
T0 = 1000.0  # absolute clock of the first event: figures must show time relative to it


# ---------------------------------------------------------------- synthetic records

def make_steps() -> list[StepRecord]:
    """4 ranks x 3 steps; rank 1 is a pipeline rank that never sees the loss (NaN)."""
    return [StepRecord(rank=r, step=s, loss=math.nan if r == 1 else 2.0 - 0.1 * s + 0.01 * r,
                       tokens=512, time_s=0.5 + 0.1 * r, plan="dp2 tp2")
            for s in range(3) for r in range(4)]


def make_memory() -> list[MemoryRecord]:
    """Two steps per rank; step 1 (the latest) has distinct values per rank and component."""
    return [MemoryRecord(rank=r, step=s, params=(r + 1) * MiB, grads=(r + 1) * MiB // 2 + s,
                         optimizer=2 * (r + 1) * MiB, activations=(3 + s) * MiB)
            for s in range(2) for r in range(4)]


def make_comms() -> list[CommRecord]:
    """all_reduce of 300 B on [0,1,2,3] from every rank; send 0->2 (64 B) probed on both ends;
    a recv on 3 from 1 (32 B) whose send was not recorded."""
    out = [CommRecord(rank=r, step=0, op="all_reduce", bytes=300, axis="dp", group=[0, 1, 2, 3],
                      start=T0 + 1 + 0.1 * r, end=T0 + 2) for r in range(4)]
    out += [CommRecord(rank=0, step=0, op="send", bytes=64, axis="pp", peer=2, start=T0, end=T0 + 0.5),
            CommRecord(rank=2, step=0, op="recv", bytes=64, axis="pp", peer=0, start=T0, end=T0 + 0.5),
            CommRecord(rank=3, step=0, op="recv", bytes=32, axis="pp", peer=1, start=T0 + 2, end=T0 + 3)]
    return out


def one_f_one_b(step: int, t0: float) -> list[PipelineEvent]:
    """2 stages x 4 microbatches, F and B of 1 s each, 1F1B: total 10 s, busy 8 s per stage."""
    s0 = [("F", 0, 0), ("F", 1, 1), ("B", 0, 3), ("F", 2, 4), ("B", 1, 5), ("F", 3, 6), ("B", 2, 7), ("B", 3, 9)]
    s1 = [("F", 0, 1), ("B", 0, 2), ("F", 1, 3), ("B", 1, 4), ("F", 2, 5), ("B", 2, 6), ("F", 3, 7), ("B", 3, 8)]
    return [PipelineEvent(rank=stage, step=step, stage=stage, microbatch=mb, action=a, start=t0 + t, end=t0 + t + 1)
            for stage, sched in ((0, s0), (1, s1)) for a, mb, t in sched]


def make_events() -> list[PipelineEvent]:
    # an earlier step with a worse schedule (all serial) that the default view must not use
    early = [PipelineEvent(rank=st, step=0, stage=st, microbatch=0, action=a, start=t, end=t + 1)
             for st, a, t in ((0, "F", 0), (1, "F", 1), (1, "B", 2), (0, "B", 3))]
    return early + one_f_one_b(step=1, t0=T0)


def make_shards() -> list[ShardRecord]:
    """4 ranks on a dp(2) x tp(2) mesh; weight [8, 4] and bias [8] are Shard(0) over tp and
    replicated over dp; w3 [2, 3, 4] is Shard(2) over tp."""
    out = []
    for r in range(4):
        dp, tp = divmod(r, 2)
        common = dict(rank=r, placements=["Replicate()", "Shard(dim=0)"], mesh_axes=["dp", "tp"],
                      coords={"dp": dp, "tp": tp})
        out.append(ShardRecord(param="layer.weight", global_shape=[8, 4], local_shape=[4, 4],
                               index=[[4 * tp, 4 * tp + 4], [0, 4]], **common))
        out.append(ShardRecord(param="layer.bias", global_shape=[8], local_shape=[4],
                               index=[[4 * tp, 4 * tp + 4]], **common))
        out.append(ShardRecord(param="w3", global_shape=[2, 3, 4], local_shape=[2, 3, 2],
                               index=[[0, 2], [0, 3], [2 * tp, 2 * tp + 2]],
                               **{**common, "placements": ["Replicate()", "Shard(dim=2)"]}))
    return out


def dicts(records):
    return [r.to_dict() for r in records]


def is_empty_state(fig: go.Figure) -> bool:
    return len(fig.data) == 0 and any(a.text == EMPTY_TEXT for a in fig.layout.annotations)


def names(fig: go.Figure) -> list[str]:
    return [t.name for t in fig.data]


# ---------------------------------------------------------------- every figure

FIGURES = [
    (loss_figure, make_steps), (throughput_figure, make_steps), (memory_figure, make_memory),
    (comm_matrix_figure, make_comms), (comm_breakdown_figure, make_comms), (timeline_figure, make_comms),
    (pipeline_figure, make_events), (sharding_figure, make_shards),
]


@pytest.mark.parametrize("func,make", FIGURES, ids=[f.__name__ for f, _ in FIGURES])
def test_empty_input_gives_empty_state(func, make):
    for empty in ([], None):
        fig = func(empty)
        assert isinstance(fig, go.Figure)
        assert is_empty_state(fig), fig.layout.annotations
        assert fig.layout.title.text


@pytest.mark.parametrize("func,make", FIGURES, ids=[f.__name__ for f, _ in FIGURES])
def test_records_draw_and_dicts_are_refused(func, make):
    fig = func(make())
    assert len(fig.data) > 0
    assert fig.layout.title.text
    assert any(ax.title.text for ax in fig.select_xaxes())  # axis labels
    assert any(ax.title.text for ax in fig.select_yaxes()) or func is sharding_figure
    with pytest.raises(TypeError, match="from_dict"):
        func(dicts(make()))
    # a file's dicts, read back through the one from_dict, draw the same figure
    assert func([from_dict(d) for d in dicts(make())]).to_dict() == fig.to_dict()


def test_wrong_kind_raises_and_mixed_lists_are_filtered():
    with pytest.raises(TypeError, match="'step'"):
        loss_figure(make_memory())
    mixed = make_steps() + make_memory()
    assert names(loss_figure(mixed)) == names(loss_figure(make_steps()))


def test_viz_does_not_import_torch_ipyparallel_or_widgets():
    code = ("import sys, interactive_parallel.viz; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ipyparallel', 'ipywidgets')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- training

def test_loss_one_line_per_rank_and_mean_skipping_nan():
    fig = loss_figure(make_steps())
    assert names(fig) == ["rank 0", "rank 2", "rank 3", "mean"]  # rank 1 only reported NaN
    assert "dp2 tp2" in fig.layout.title.text
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["rank 2"].x) == [0, 1, 2]
    assert by_name["rank 2"].y[1] == pytest.approx(2.0 - 0.1 + 0.02)
    mean = by_name["mean"]
    assert mean.line.width > by_name["rank 0"].line.width
    for i, s in enumerate(mean.x):
        assert mean.y[i] == pytest.approx(sum(2.0 - 0.1 * s + 0.01 * r for r in (0, 2, 3)) / 3)


def test_loss_figure_shows_the_gradient_norm_when_clipping():
    from dataclasses import replace

    clipped = [replace(r, grad_norm=3.0 / (1 + r.step)) for r in make_steps()]  # every rank: the model's norm
    fig = loss_figure(clipped)
    assert names(fig) == ["rank 0", "rank 2", "rank 3", "mean", "gradient norm (before clipping)"]
    norm = fig.data[-1]
    assert list(norm.x) == [0, 1, 2] and list(norm.y) == [3.0, 1.5, 1.0] and norm.yaxis == "y2"
    assert fig.layout.yaxis2.title.text == "gradient norm" and fig.layout.yaxis2.overlaying == "y"


def test_loss_all_nan_is_empty():
    assert is_empty_state(loss_figure([StepRecord(rank=0, step=0, loss=math.nan, tokens=1, time_s=1.0)]))


def test_throughput_two_subplots_per_rank():
    fig = throughput_figure(make_steps())
    assert len(fig.data) == 8
    assert names(fig) == [f"rank {r}" for r in range(4) for _ in range(2)]
    time_trace, tps_trace = fig.data[2], fig.data[3]  # rank 1
    assert time_trace.yaxis == "y" and tps_trace.yaxis == "y2"
    assert list(time_trace.y) == pytest.approx([0.6] * 3)
    assert list(tps_trace.y) == pytest.approx([512 / 0.6] * 3)
    assert [t.showlegend for t in fig.data[:2]] == [True, False]
    assert fig.layout.yaxis.title.text == "step time (s)" and fig.layout.yaxis2.title.text == "tokens/s"


# ---------------------------------------------------------------- memory

def test_memory_stacks_equal_latest_bytes():
    fig = memory_figure(make_memory())
    assert names(fig) == ["params", "grads", "optimizer", "activations"]
    assert fig.layout.barmode == "group" and fig.layout.yaxis.title.text == "MiB"
    latest = {m.rank: m for m in make_memory() if m.step == 1}
    tops = [0.0] * 4
    for trace in fig.data:
        assert trace.offsetgroup == "measured"
        assert list(trace.x) == [f"rank {r}" for r in range(4)]
        for i, r in enumerate(range(4)):
            assert trace.y[i] * MiB == pytest.approx(getattr(latest[r], trace.name))
            assert trace.base[i] == pytest.approx(tops[i])  # stacked on the components below
            tops[i] += trace.y[i]
    for r in range(4):
        m = latest[r]
        assert tops[r] * MiB == pytest.approx(m.params + m.grads + m.optimizer + m.activations)


def test_memory_predicted_beside_measured():
    predicted = [MemoryRecord(rank=r, step=-1, params=MiB, grads=MiB, optimizer=2 * MiB) for r in range(4)]
    fig = memory_figure(make_memory(), predicted=predicted)
    assert len(fig.data) == 8
    assert {t.offsetgroup for t in fig.data[:4]} == {"measured"}
    assert {t.offsetgroup for t in fig.data[4:]} == {"predicted"}
    assert names(fig)[4:] == [f"{c} (predicted)" for c in ("params", "grads", "optimizer", "activations")]
    opt = fig.data[6]
    assert list(opt.y) == pytest.approx([2.0] * 4) and list(opt.base) == pytest.approx([2.0] * 4)
    only_predicted = memory_figure([], predicted=predicted)
    assert len(only_predicted.data) == 4 and not is_empty_state(only_predicted)


# ---------------------------------------------------------------- communication

def test_comm_matrix_convention_and_total():
    ranks, m = comm_matrix(make_comms())
    assert ranks == [0, 1, 2, 3]
    assert m[0][1] == pytest.approx(100)        # 300 B all_reduce split over 3 others
    assert m[0][2] == pytest.approx(100 + 64)   # plus the send, counted once (its recv is matched)
    assert m[1][3] == pytest.approx(100 + 32)   # the unmatched recv counts peer -> rank
    assert m[2][0] == pytest.approx(100)
    assert all(m[i][i] == 0 for i in range(4))
    total = sum(map(sum, m))
    assert total == pytest.approx(4 * 300 + 64 + 32)
    fig = comm_matrix_figure(make_comms())
    assert len(fig.data) == 1 and fig.data[0].type == "heatmap"
    assert sum(map(sum, fig.data[0].z)) == pytest.approx(total)
    assert list(fig.data[0].x) == [f"rank {r}" for r in range(4)]


def test_comm_breakdown_by_axis_and_op():
    sums = comm_breakdown(make_comms())
    assert sums == {("dp", "all_reduce"): 1200, ("pp", "send"): 64, ("pp", "recv"): 32}
    fig = comm_breakdown_figure(make_comms())
    assert fig.layout.barmode == "stack"
    assert names(fig) == ["all_reduce", "send", "recv"]
    assert list(fig.data[0].x) == ["pp", "dp"]  # mesh order, outermost first
    assert list(fig.data[0].y) == [0, 1200] and list(fig.data[1].y) == [64, 0]
    assert sum(sum(t.y) for t in fig.data) == sum(map(sum, comm_matrix(make_comms())[1]))


# ---------------------------------------------------------------- timeline and pipeline

def test_timeline_bars_relative_to_first_event():
    fig = timeline_figure(make_comms(), make_events(), steps=[0, 1])
    assert names(fig) == ["all_reduce", "send", "recv", "F: forward", "B: backward"]
    for t in fig.data:
        assert t.type == "bar" and t.orientation == "h"
    assert {t.offsetgroup for t in fig.data[:3]} == {"comm"}
    assert {t.offsetgroup for t in fig.data[3:]} == {"pipeline"}
    # step 0 pipeline events start at clock 0, far before the comms at T0: the earliest start is 0
    assert min(min(t.base) for t in fig.data) == 0
    only_comms = timeline_figure(make_comms())
    send = only_comms.data[1]
    # in milliseconds from the first event (the records hold seconds)
    assert list(send.base) == [0.0] and list(send.x) == pytest.approx([500.0]) and list(send.y) == ["rank 0"]
    allreduce = only_comms.data[0]
    assert list(allreduce.base) == pytest.approx([1000.0, 1100.0, 1200.0, 1300.0])
    assert list(allreduce.x) == pytest.approx([1000.0, 900.0, 800.0, 700.0])
    assert only_comms.layout.xaxis.title.text == "ms since the first event"
    assert list(only_comms.layout.yaxis.categoryarray) == [f"rank {r}" for r in range(4)]


def test_timeline_step_filter_and_untimed_records():
    fig = timeline_figure(make_comms(), make_events(), steps=1)
    assert names(fig) == ["F: forward", "B: backward"]
    assert min(min(t.base) for t in fig.data) == 0 and max(max(t.base) for t in fig.data) == 9000  # ms
    untimed = [CommRecord(rank=0, step=0, op="all_reduce", bytes=8)]
    assert is_empty_state(timeline_figure(untimed))


def test_pipeline_bubble_of_hand_made_1f1b():
    assert bubble_fractions(make_events()) == pytest.approx({0: 0.2, 1: 0.2})
    assert bubble_fractions(make_events(), step=0) == pytest.approx({0: 0.5, 1: 0.5})
    fig = pipeline_figure(make_events())
    assert "step 1" in fig.layout.title.text and "bubble 20.0%" in fig.layout.title.text
    assert names(fig) == ["F: forward", "B: backward"]
    fwd, bwd = fig.data
    assert len(fwd.x) == 8 and len(bwd.x) == 8
    assert fwd.marker.color != bwd.marker.color
    assert sorted(set(fwd.y)) == ["stage 0", "stage 1"]
    assert list(fwd.text[:4]) == ["0", "1", "2", "3"]  # stage 0 forwards, labelled by microbatch
    assert list(fwd.base[:4]) == [0, 1000, 4000, 6000]  # ms from the step's first event


def test_bubble_counts_overlaps_once():
    ev = [PipelineEvent(rank=0, step=0, stage=0, microbatch=0, action="F", start=0, end=2),
          PipelineEvent(rank=0, step=0, stage=0, microbatch=1, action="F", start=1, end=3),
          PipelineEvent(rank=1, step=0, stage=1, microbatch=0, action="F", start=3, end=4)]
    assert bubble_fractions(ev) == pytest.approx({0: 0.25, 1: 0.75})
    assert "bubble 50.0%" in pipeline_figure(ev).layout.title.text


# ---------------------------------------------------------------- sharding

def test_sharding_2d_replicated_regions():
    fig = sharding_figure(make_shards(), "layer.weight")
    assert names(fig) == ["rank 0, 2", "rank 1, 3"]  # Shard(0) over tp, replicated over dp
    top = fig.data[0]
    assert [v for v in top.x if v is not None] == [0, 4, 4, 0, 0]
    assert [v for v in top.y if v is not None] == [0, 0, 4, 4, 0]
    labels = [a.text for a in fig.layout.annotations]
    assert labels == ["rank 0 (dp=0, tp=0)<br>rank 2 (dp=1, tp=0)", "rank 1 (dp=0, tp=1)<br>rank 3 (dp=1, tp=1)"]
    assert "Shard(dim=0)" in fig.layout.title.text
    assert list(fig.layout.yaxis.range) == [8, 0] and list(fig.layout.xaxis.range) == [0, 4]


def test_sharding_1d_and_flattened_3d():
    bias = sharding_figure(make_shards(), "layer.bias")
    assert len(bias.data) == 2 and list(bias.layout.yaxis.range) == [1, 0]
    regions = shard_regions(make_shards(), "w3")
    assert [(rows, cols) for (rows, cols), _ in regions] == [
        ((0, 2), ((0, 2), (4, 6), (8, 10))), ((0, 2), ((2, 4), (6, 8), (10, 12)))]
    assert [[h.rank for h in holders] for _, holders in regions] == [[0, 2], [1, 3]]
    fig = sharding_figure(make_shards(), "w3")
    assert list(fig.layout.xaxis.range) == [0, 12]
    assert sum(v is None for v in fig.data[0].x) == 3  # three stripes


def test_sharding_unknown_param():
    fig = sharding_figure(make_shards(), "nope")
    assert len(fig.data) == 0 and "nope" in fig.layout.annotations[0].text


def test_layout_table_is_plain_rows():
    rows = layout_table(make_shards())
    assert len(rows) == 12
    assert rows[0] == {"param": "layer.bias", "rank": 0, "stage": None, "coords": "dp=0, tp=0",
                       "placements": "dp: Replicate(), tp: Shard(dim=0)", "global_shape": [8],
                       "local_shape": [4], "index": "[0:4]"}
    weight_rank3 = next(r for r in rows if r["param"] == "layer.weight" and r["rank"] == 3)
    assert weight_rank3["index"] == "[4:8, 0:4]"
    assert layout_table([]) == []


# ---------------------------------------------------------------- report

def all_records():
    return make_steps() + make_memory() + make_comms() + make_events() + make_shards()


def test_figures_from_records_builds_all_with_data():
    figs = figures_from_records(all_records())
    assert list(figs) == ["loss", "throughput", "memory", "comm_matrix", "comm_breakdown", "comm_tree", "timeline",
                          "pipeline", "sharding-layer-bias", "sharding-layer-weight", "sharding-w3"]
    assert all(isinstance(f, go.Figure) and len(f.data) > 0 for f in figs.values())
    assert list(figures_from_records(make_steps())) == ["loss", "throughput"]
    assert figures_from_records([]) == {}


def test_write_report_sections_and_one_plotlyjs(tmp_path):
    figs = figures_from_records(all_records())
    path = write_report(tmp_path / "sub" / "report.html", figs, title="Run <1>",
                        summary_html="<p id='summary'>4 ranks</p>")
    assert path.exists()
    text = path.read_text(encoding="utf-8")
    for key in figs:
        assert f'<section id="{key}">' in text
    assert text.count("<section") == len(figs)
    plotlyjs = get_plotlyjs()
    marker = plotlyjs[len(plotlyjs) // 2: len(plotlyjs) // 2 + 80]
    assert text.count(marker) == 1
    assert "Run &lt;1&gt;" in text and "Generated at" in text and "<p id='summary'>4 ranks</p>" in text
    assert "<h2>Training loss (dp2 tp2)</h2>" in text


def test_write_report_without_figures(tmp_path):
    path = write_report(str(tmp_path / "empty.html"), {})
    assert "No figures" in path.read_text(encoding="utf-8")


@pytest.mark.pure
def test_interleaved_bubble_is_counted_per_rank():
    # rank 0 runs stages 0 and 2 back to back: each stage row idles half the time, the rank never
    ev = [PipelineEvent(rank=0, step=0, stage=0, microbatch=0, action="F", start=0, end=1),
          PipelineEvent(rank=0, step=0, stage=2, microbatch=0, action="F", start=1, end=2)]
    assert bubble_fractions(ev) == pytest.approx({0: 0.0})
    assert bubble_fractions(ev, by="stage") == pytest.approx({0: 0.5, 2: 0.5})
    assert "bubble 0.0%" in pipeline_figure(ev).layout.title.text


# ---------------------------------------------------------------- titles that fit

def title_lines_of(fig: go.Figure) -> list[str]:
    """The title's lines as they are drawn (a '<br>' starts a line; other tags draw nothing)."""
    import re

    return [re.sub(r"<[^>]+>", "", line) for line in (fig.layout.title.text or "").split("<br>")]


def many_ranks_events() -> list[PipelineEvent]:
    """8 ranks over 2 stages (dp4 beside pp2): the idle share of every rank could not fit a line."""
    return [PipelineEvent(rank=4 * stage + d, step=0, stage=stage, microbatch=0, action="F",
                          start=stage + 0.1 * d, end=stage + 1) for stage in range(2) for d in range(4)]


def long_param_shards() -> list[ShardRecord]:
    name = "model.layers.11.self_attn.q_proj.weight"
    return [ShardRecord(param=name, rank=r, global_shape=[64, 64], local_shape=[32, 64],
                        index=[[32 * r, 32 * r + 32], [0, 64]], placements=["Shard(dim=0)"], mesh_axes=["tp"],
                        coords={"tp": r}, stage=0) for r in range(2)]


def test_every_title_fits_the_narrowest_figure_in_lines_of_title_chars():
    from interactive_parallel.plan import Plan
    from interactive_parallel.viz import TITLE_CHARS, mesh_figure, title_with
    from interactive_parallel.viz._common import TITLE_LINE_PX, TITLE_SIZE, TITLE_TOP_PX

    figures = [func(make()) for func, make in FIGURES] + [func(None) for func, _ in FIGURES] + [
        comm_matrix_figure([CommRecord(rank=r, step=0, op="all_reduce", bytes=10 * MiB, axis="dp_fsdp",
                                       group=list(range(64))) for r in range(64)]),
        pipeline_figure(many_ranks_events()), sharding_figure(long_param_shards()),
        mesh_figure(Plan(dp=16, tp=8, pp=8), shards=long_param_shards(), param=long_param_shards()[0].param,
                    comms=[CommRecord(rank=0, step=0, op="all_reduce", bytes=8, axis="tp", group=list(range(8)))],
                    source="dry run")]
    for fig in figures:
        lines = title_lines_of(fig)
        assert lines[0] and all(len(line) <= TITLE_CHARS for line in lines), lines
        assert fig.layout.title.font.size == TITLE_SIZE and fig.layout.title.yanchor == "bottom"
        assert fig.layout.margin.t >= TITLE_TOP_PX + TITLE_LINE_PX * len(lines)  # the plot area starts below it
        labelled = title_with(fig.layout.title.text, "(dry run)")
        assert labelled.endswith("(dry run)") and all(len(line) <= TITLE_CHARS for line in labelled.split("<br>"))
    # a part that fits a line is never cut, and nothing is lost when breaking one that does not
    mesh = title_lines_of(figures[-1])
    assert any(line.startswith("1024 ranks (pp 8 x dp 16 x tp 8);") for line in mesh), mesh
    assert "model.layers.11.self_attn.q_proj.weight" in title_lines_of(figures[-2])
    assert "(idle per rank 50% to 65%)" in " ".join(title_lines_of(pipeline_figure(many_ranks_events())))


# ---------------------------------------------------------------- schedule preview

def make_preview():
    """pp 2, 2 microbatches of 1F1B as the simulator lays it out, sends and receives included."""
    from interactive_parallel.records import ScheduleAction, SchedulePreview

    rows = {0: ["0F0", "0SEND_F0", "0F1", "0SEND_F1", None, "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
            1: [None, "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]}
    acts = [ScheduleAction(rank=r, slot=i, stage=int(a[0]), microbatch=int(a[-1]), action=a[1:-1])
            for r, row in rows.items() for i, a in enumerate(row) if a]
    return SchedulePreview(schedule="1f1b", torch_class="Schedule1F1B", pp=2, microbatches=2, stages_per_rank=1,
                           actions=acts, slots=9, idle={0: 5 / 9, 1: 5 / 9})


def test_schedule_figure_rows_per_rank_and_comm_actions_shown():
    from interactive_parallel.viz import schedule_figure

    fig = schedule_figure(make_preview())
    by = {t.name: t for t in fig.data}
    assert set(by) == {"F: forward", "B: full backward", "send activations", "receive activations",
                       "send gradients", "receive gradients"}
    fwd = by["F: forward"]
    assert list(fwd.y) == ["rank 0", "rank 0", "rank 1", "rank 1"] and list(fwd.base) == [0, 2, 2, 6]
    assert list(fwd.text) == ["0<br>s0", "1<br>s0", "0<br>s1", "1<br>s1"]  # microbatch, then stage
    assert by["send activations"].width < fwd.width and not any(by["send activations"].text)
    assert "simulated idle rank 0 56%, rank 1 56%" in fig.layout.title.text.replace("<br>", " ")


def test_schedule_figure_beside_measured_reuses_the_pipeline_picture():
    from interactive_parallel.viz import schedule_figure

    fig = schedule_figure(make_preview(), make_events())
    measured = [t for t in fig.data if t.xaxis == "x2"]
    assert [t.name for t in measured] == ["F: forward", "B: backward"]  # pipeline_figure's traces
    assert not any(t.showlegend for t in measured)
    assert [a.text for a in fig.layout.annotations] == ["simulated (torch)", "measured"]
    title = fig.layout.title.text.replace("<br>", " ")
    assert "measured idle rank 0 20%, rank 1 20%" in title and "(bubble 20%)" in title  # bubble_fractions'
    assert "xaxis2" not in schedule_figure(make_preview(), None).layout  # no measured panel


def test_schedule_figure_round_trips_and_empty_preview():
    from interactive_parallel.records import SchedulePreview, from_dict
    from interactive_parallel.viz import schedule_figure

    p = make_preview()
    back = from_dict(p.to_dict())
    assert back.actions == p.actions and back.order(1) == ["1F0", "1B0", "1F1", "1B1"]
    assert back.order(0, compute_only=False)[:2] == ["0F0", "0SEND_F0"]
    empty = SchedulePreview(schedule="1f1b", torch_class="Schedule1F1B", pp=1, microbatches=1, stages_per_rank=1)
    fig = schedule_figure(empty)
    assert not fig.data and "no pipeline" in fig.layout.annotations[0].text


def test_collective_lanes_mark_the_rank_that_never_issued_the_collective_its_peers_wait_in():
    from interactive_parallel.records.stacks import CollectiveRecord
    from interactive_parallel.viz import collective_lanes_figure
    from interactive_parallel.viz.collectives import NO_COLLECTIVES

    def c(rank, seq, group="world", members=(0, 1, 2, 3), op="all_reduce"):
        return CollectiveRecord(rank=rank, group=group, seq=seq, op=op, ranks=list(members), in_sizes=[[4]],
                                time=float(seq))

    world = [c(r, s) for r in range(4) for s in (56, 57)] + [c(r, 58, op="all_gather") for r in (0, 2, 3)]
    tp = [c(r, s, "tp", (0, 1) if r < 2 else (2, 3)) for r in range(4) for s in (1, 2)]
    fig = collective_lanes_figure(world + tp)  # the group of the first mismatch: the world's
    assert names(fig) == ["all_gather", "all_reduce"] and "world [0, 1, 2, 3]" in fig.layout.title.text
    gather = fig.data[0]
    assert list(gather.x) == [58, 58, 58] and list(gather.y) == ["rank 0", "rank 2", "rank 3"]
    assert [s.x0 for s in fig.layout.shapes] == [58]
    assert any(a.text == "rank(s) [1] never issued #58" for a in fig.layout.annotations)
    agreed = collective_lanes_figure(world + tp, group="tp")  # both tp groups agree: nothing marked
    assert not agreed.layout.shapes and "first mismatch" not in agreed.layout.title.text
    with pytest.raises(ValueError, match="groups are tp, world"):
        collective_lanes_figure(world + tp, group="pp")
    for empty in ([], None):  # its own empty state: collectives come from a question, not a step
        assert [a.text for a in collective_lanes_figure(empty).layout.annotations] == [NO_COLLECTIVES]
    with pytest.raises(TypeError, match="from_dict"):
        collective_lanes_figure(dicts(world))
