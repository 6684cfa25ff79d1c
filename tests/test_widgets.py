"""The control panel (widgets/) without a browser: against a fake session whose signatures and
return types are checked against Session's (pure), and against a live 4-rank Session (session).
Clicks are `button.click()`; training and generation run as the panel's Job in a thread here (no
kernel loop), so tests `wait()` for them."""
from __future__ import annotations

import dataclasses
import html
import inspect
import re
import time
import types
import typing
from dataclasses import dataclass

import ipywidgets as W
import plotly.graph_objects as go
import pytest
from fake_session import ELEMENTS, WORLD, FakeSession

import interactive_parallel as ip
from interactive_parallel import viz
from interactive_parallel.cluster import Session
from interactive_parallel.plan import Plan
from interactive_parallel.records import RecordList, StepRecord, VerifyReport
from interactive_parallel.viz import loss_figure
from interactive_parallel.widgets import Panel, panel
from interactive_parallel.widgets import cluster as cluster_mod
from interactive_parallel.widgets import planner as planner_mod
from interactive_parallel.widgets._common import refresh
from interactive_parallel.widgets.events import JobEnded, JobKind, RanksChanged
from interactive_parallel.widgets.fit import FitFigures


def names(session) -> list[str]:
    return [c[0] for c in session.calls]


READS = {"memory", "comms", "timeline", "experts", "predict_memory", "decoding", "served", "quantized"}
"""Session methods that read what the client already holds (no rank is asked)."""


def asked(session) -> list[tuple]:
    """The session calls that ask the ranks something (the figures' local reads left out)."""
    return [c for c in session.calls if c[0] not in READS]


def actions(session) -> list[str]:
    return [c[0] for c in asked(session)]


def all_widgets(w) -> list:
    out = [w]
    for child in getattr(w, "children", ()) or ():
        out += all_widgets(child)
    return out


def every_widget(p: Panel) -> list:
    """The panel's widgets, the pages of closed view tabs included (only the open one is mounted)."""
    return all_widgets(p) + [w for page in p.views.pages.values() for w in all_widgets(page)]


def classes(p: Panel) -> set[str]:
    return {c for w in every_widget(p) for c in getattr(w, "_dom_classes", ())}


def shown(widget: W.HTML) -> str:
    """An HTML widget's text as a reader sees it (tags dropped, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]+>", " ", widget.value))


def until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def laid_out(**kw) -> tuple[FakeSession, Panel]:
    s = FakeSession(**kw)
    s.load_model("tiny-llama")
    s.apply(Plan(dp=WORLD))
    return s, Panel(s)


@pytest.fixture(autouse=True)
def _no_torch(monkeypatch):
    # The no-session path asks torch about GPUs; pure tests need no torch import.
    monkeypatch.setattr(cluster_mod, "cuda_unavailable_reason", lambda session=None: "no GPU (test)")


# ---- the fake cannot drift from Session -----------------------------------------------------------
def resolved(fn) -> inspect.Signature:
    """The signature with its annotations evaluated (a blocking twin answers for its coroutine)."""
    return inspect.signature(getattr(fn, "__wrapped_async__", fn), eval_str=True)


@pytest.mark.pure
def test_the_fake_has_sessions_signatures():
    public = {n: v for n, v in vars(FakeSession).items() if not n.startswith("_")}
    assert {"train_async", "generate_async", "verify", "predict_memory", "alive"} <= set(public)
    for name, fake in public.items():
        real = getattr(Session, name, None)
        assert real is not None, f"Session has no {name}: the fake must not offer what Session lacks"
        if isinstance(fake, property):
            assert isinstance(real, property), name
            continue
        assert inspect.iscoroutinefunction(fake) == inspect.iscoroutinefunction(real), name
        assert resolved(fake) == resolved(real), f"{name}{resolved(fake)} != Session.{name}{resolved(real)}"


@pytest.mark.pure
def test_the_fake_returns_the_types_session_declares():
    import asyncio

    s = FakeSession()
    s.load_model("tiny-llama")
    s.apply(Plan(dp=2, pp=2, microbatches=2))
    tokens = []
    values = {
        "check_plan": s.check_plan(s.plan), "load_model": s.load_model("tiny-llama"), "apply": s.apply(s.plan),
        "train_async": asyncio.run(s.train_async(2)), "doctor": s.doctor(), "verify": s.verify(),
        "generate_async": asyncio.run(s.generate_async(["ab"], 3, on_token=tokens.append)),
        "memory": s.memory(), "comms": s.comms(), "timeline": s.timeline(), "experts": s.experts(),
        "layout": s.layout(), "fetch": s.fetch("lm_head.weight", 1),
        "predict_memory": s.predict_memory(), "save": s.save("c"), "load": s.load("c"),
        "export_script": s.export_script("x.py"), "run": s.run(lambda: 1),
        "serve_async": asyncio.run(s.serve_async(["ab", "cd"], on_token=tokens.append)),
        "quantize": s.quantize("int8-weight-only"), "decoding": s.decoding(), "served": s.served(),
        "quantized": s.quantized(), "dequantize": s.dequantize(), "dry_run": s.dry_run(Plan(dp=8)),
        "calibrate": s.calibrate(), "predict_step": s.predict_step(), "search_plans": s.search_plans(top=3),
        "calibrate_async": asyncio.run(s.calibrate_async()), "stacks_async": asyncio.run(s.stacks_async()),
        "collectives_async": asyncio.run(s.collectives_async()),
        "interrupt": s.interrupt(), "stop": s.stop(),
    }
    assert set(values) == {n for n, v in vars(FakeSession).items() if not n.startswith("_") and callable(v)}
    for name, value in values.items():
        declared = typing.get_type_hints(getattr(Session, name))["return"]
        if isinstance(declared, types.UnionType):  # X | None: any of its members
            declared = tuple(typing.get_origin(t) or t for t in typing.get_args(declared))
        assert isinstance(value, typing.get_origin(declared) or declared or type(None)), (name, value)
        if name in ELEMENTS:
            assert value and all(isinstance(v, ELEMENTS[name]) for v in value), name
    step = values["train_async"][0]
    assert step.memory is not None and step.comms and step.events  # what the probes attach under pp
    assert [type(t).__name__ for t in tokens] == ["TokenRecord"] * (3 + 2 * 16) and tokens[2].done


# ---- the panel ----------------------------------------------------------------------------------------
@pytest.mark.pure
def test_panel_builds_with_a_css_class_on_every_control_and_figure():
    p = Panel(FakeSession())
    plan_fields = {f"ip-{f.name.replace('_', '-')}" for f in dataclasses.fields(Plan) if f.name != "device"}
    expected = plan_fields | {
        "ip-panel", "ip-error-output", "ip-device", "ip-ranks", "ip-start-button", "ip-attach-button",
        "ip-stop-cluster-button", "ip-doctor-button", "ip-rank-status", "ip-model-preset", "ip-model-path",
        "ip-load-model-button", "ip-plan-messages", "ip-memory-prediction", "ip-apply-button", "ip-train-steps",
        "ip-train-button", "ip-interrupt-button", "ip-run-progress", "ip-run-status", "ip-prompts", "ip-max-tokens",
        "ip-do-sample", "ip-temperature", "ip-top-k", "ip-generate-button", "ip-generate-output", "ip-verify-button",
        "ip-save-button", "ip-load-checkpoint-button", "ip-export-button", "ip-views", "ip-loss-figure",
        "ip-memory-figure", "ip-comm-matrix-figure", "ip-comm-breakdown-figure", "ip-comm-tree-figure",
        "ip-timeline-figure", "ip-layout-param", "ip-sharding-figure", "ip-pipeline-figure", "ip-serve-count", "ip-serve-gap",
        "ip-serve-max-tokens", "ip-serve-max-batch", "ip-serve-engine", "ip-serve-policy", "ip-serve-button",
        "ip-serve-output", "ip-quantize-scheme", "ip-quantize-button", "ip-dequantize-button", "ip-quantize-output",
        "ip-tokens-per-step-figure", "ip-kv-memory-figure", "ip-step-split-figure", "ip-request-timeline-figure",
        "ip-latency-figure", "ip-quantization-figure", "ip-dry-run", "ip-dry-run-button", "ip-dry-run-status",
        "ip-mesh-figure", "ip-expert-load-figure", "ip-tokens-moved-figure", "ip-where-button", "ip-where-output", "ip-where-lanes-figure"}
    assert expected <= classes(p), sorted(expected - classes(p))
    assert len({id(w) for w in every_widget(p) if isinstance(w, go.FigureWidget)}) == 20
    assert "hostA" in p.cluster.status.value and "1003" in p.cluster.status.value
    # device: cuda is not offered, and the panel says why
    assert p.cluster.device.options == ("cpu",) and "no GPU" in p.cluster.device_note.value
    # a live session: Start/Attach off, Stop on; Stop (interrupt) only while training or generating
    assert p.cluster.start.disabled and not p.cluster.stop.disabled and p.run_section.interrupt.disabled
    assert panel(FakeSession()).session is not None


@pytest.mark.pure
def test_controls_sit_beside_the_figures_in_an_applayout():
    p = Panel(FakeSession())
    columns = p.columns
    assert isinstance(columns, W.AppLayout) and columns.center is p.views.widget
    sections = columns.left_sidebar.children
    assert list(sections) == [p.cluster.widget, p.plan_section.widget, p.run_section.widget,
                              p.serve_section.widget]
    assert columns.layout.grid_template_areas == '"left-sidebar center center"'
    # the browser reports each figure's element width; the figure takes it, and keeps it on refresh
    fit = next(w for w in p.children if isinstance(w, FitFigures))
    assert set(fit.figures) == {f"ip-{n}-figure" for n in ("loss", "memory", "comm-matrix", "comm-breakdown",
                                                          "comm-tree", "timeline", "sharding", "pipeline", "tokens-per-step",
                                                          "kv-memory", "step-split", "request-timeline", "latency",
                                                          "quantization", "mesh", "expert-load", "tokens-moved",
                                                          "plans", "step-time")}
    fit.widths = {"ip-loss-figure": 612, "ip-memory-figure": 0}
    assert p.views.loss.layout.width == 612 and p.views.memory.layout.width is None
    refresh(p.views.loss, loss_figure([StepRecord(rank=0, step=0, loss=1.0, tokens=1, time_s=1.0)]))
    assert p.views.loss.layout.width == 612 and p.views.loss.data


@pytest.mark.pure
def test_tab_labels_and_every_figure_title_fit_their_width():
    from interactive_parallel.viz import TITLE_CHARS, TITLE_FITS_PX
    from interactive_parallel.widgets import views as views_mod

    s, p = laid_out()
    v = p.views
    assert len(v.tab.titles) == len(views_mod.TABS) and all(len(t) <= views_mod.TAB_CHARS for t in v.tab.titles)
    # side by side only while each keeps the width a title line fits
    grid = v.pages["communication"].children[1]
    assert f"{TITLE_FITS_PX}px" in grid.layout.grid_template_columns and "auto-fit" in grid.layout.grid_template_columns

    def titles() -> dict[str, list[str]]:
        shown = {**v.figures, "ip-mesh-figure": p.plan_section.dry.mesh}
        return {cls: re.sub(r"<(?!br>)[^>]+>", "", w.layout.title.text or "").split("<br>") for cls, w in shown.items()}

    def check() -> None:
        for cls, lines in titles().items():
            assert lines[0] and all(len(line) <= TITLE_CHARS for line in lines), (cls, lines)

    check()
    p.plan_section.fields["dp"].value, p.plan_section.fields["pp"].value = 2, 2
    p.plan_section.fields["microbatches"].value = 2
    p.plan_section.apply.click()
    p.train(2).wait(10)
    p.generate("abc").wait(10)
    p.serve(3).wait(10)
    p.quantize("int8-weight-only")
    for tab in range(len(views_mod.TABS)):
        v.tab.selected_index = tab
    assert p.error_text == "" and len(titles()["ip-pipeline-figure"]) >= 2  # the bubble and each rank's idle
    check()
    p.plan_section.dry.switch.value = True
    p.plan_section.dry.run.click()
    for tab in (1, 2, 3):
        v.tab.selected_index = tab
    assert titles()["ip-memory-figure"][-1].endswith("(dry run)")
    check()


@pytest.mark.pure
def test_only_the_panel_knows_the_sections():
    """A section gets what it needs at construction and raises events; none imports another."""
    import ast
    import pathlib

    from interactive_parallel import widgets

    root = pathlib.Path(widgets.__file__).parent
    sections = {"cluster", "planner", "run", "serve", "views"}
    for path in root.glob("*.py"):
        if path.stem in ("panel", "__init__"):
            continue
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1}
        assert not imported & sections, f"{path.name} imports the section {imported & sections}"
        assert "Panel" not in path.read_text(), f"{path.name} names the Panel"


@dataclass(frozen=True, kw_only=True)
class LaterPlan(Plan):
    """A Plan with fields a later issue might add."""

    offload: bool = False
    """Keep optimizer state in host memory."""
    dropout: float = 0.0
    """Dropout probability."""
    quantize: str = "none"
    """Weight quantization scheme."""


@pytest.mark.pure
def test_plan_section_offers_every_plan_field_including_ones_added_later(monkeypatch):
    p = Panel(FakeSession())
    fields = p.plan_section.fields
    assert set(fields) == {f.name for f in dataclasses.fields(Plan)} - {"device"}
    assert isinstance(fields["sequence_parallel"], W.Checkbox) and isinstance(fields["lr"], W.FloatText)
    assert isinstance(fields["virtual_stages"], W.IntText) and isinstance(fields["seed"], W.IntText)
    assert fields["pp_schedule"].options == ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
    assert fields["cp_method"].options == ("allgather", "ring") and isinstance(fields["compile"], W.Checkbox)
    assert isinstance(fields["stage_layers"], W.Text) and fields["stage_layers"].value == "()"
    fields["stage_layers"].value = "(1, 3)"
    assert p.plan_section.plan().stage_layers == (1, 3)
    fields["stage_layers"].value = "()"
    assert fields["precision"].options == ("fp32", "bf16", "fp16")
    assert "sequence too" in fields["sequence_parallel"].tooltip  # the field's docstring
    fields["seed"].value = 7
    fields["sequence_parallel"].value = True
    assert p.plan_section.plan() == Plan(dp=WORLD, seed=7, sequence_parallel=True)

    monkeypatch.setattr(planner_mod, "Plan", LaterPlan)
    later = Panel(FakeSession()).plan_section
    assert isinstance(later.fields["offload"], W.Checkbox) and isinstance(later.fields["dropout"], W.FloatText)
    assert isinstance(later.fields["quantize"], W.Text) and later.fields["offload"].tooltip.startswith("Keep")
    later.fields["offload"].value = True
    later.fields["dropout"].value = 0.1
    assert later.plan() == LaterPlan(dp=WORLD, offload=True, dropout=0.1)


MOE = dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
           max_position_embeddings=256)
"""A tiny mixture-of-experts config (transformers' Mixtral): 4 experts, top 2."""


@pytest.mark.pure
def test_the_ep_degree_shows_only_for_a_model_with_experts_and_the_experts_view_draws_its_routing():
    s, p = laid_out()
    section = p.plan_section
    ep = section.fields["ep"]
    assert ep in section.degree_grid.children and ep.layout.display == "none"  # tiny-llama: dense
    assert "repeat(5," in section.degree_grid.layout.grid_template_columns
    s.load_model(MOE)
    p.notify(RanksChanged())
    assert ep.layout.display != "none" and "repeat(6," in section.degree_grid.layout.grid_template_columns
    ep.value = 2
    assert section.plan() == Plan(dp=WORLD, ep=2) and "ep2" in shown(section.messages)
    assert "cannot run" not in shown(section.messages)
    section.apply.click()
    assert asked(s)[-1] == ("apply", Plan(dp=WORLD, ep=2))
    assert p.train(2).wait(10) and p.error_text == ""
    v = p.views
    v.tab.selected_index = v.tab.titles.index("experts")
    assert ("experts",) in s.calls
    load = [list(row) for row in v.expert_load.data[0].z]
    assert load == [list(r) for r in viz.expert_load(s.experts(1)).values()] and sum(load[0]) == WORLD * 128 * 2
    assert "step 1" in v.expert_load.layout.title.text and "imbalance" in v.expert_load.layout.title.text
    moved = viz.tokens_moved(s.experts(1))
    assert sum(map(sum, v.tokens_moved.data[0].z)) == sum(moved.values()) > 0
    assert "KiB each way" in v.tokens_moved.layout.title.text  # hidden 64 x fp32 per pair
    s.load_model("tiny-llama")  # dense again: the degree hides and goes back to 1
    p.notify(RanksChanged())
    assert ep.layout.display == "none" and ep.value == 1 and section.plan().ep == 1


@pytest.mark.pure
def test_the_experts_view_of_a_dense_model_says_why_it_is_empty():
    s, p = laid_out()
    p.train(1).wait(10)
    p.views.tab.selected_index = p.views.tab.titles.index("experts")
    assert "dense model" in shown(p.views.messages["experts"]) and not p.views.expert_load.data
    assert any(a.text == "no mixture-of-experts records" for a in p.views.expert_load.layout.annotations)


@pytest.mark.pure
def test_validation_messages_follow_the_pickers_before_anything_runs():
    s = FakeSession()
    p = Panel(s)
    f = p.plan_section.fields
    msgs = p.plan_section.messages
    assert "fits 4 ranks" in shown(msgs)
    f["dp"].value = 2
    f["tp"].value = 3
    assert "= 6 != ranks(4)" in shown(msgs) and "tp(3) does not divide num_attention_heads(4)" in shown(msgs)
    f["tp"].value = 2
    f["sequence_parallel"].value = True
    f["seq_len"].value = 63
    assert "seq_len(63) is not divisible by tp(2) under sequence parallel" in shown(msgs)
    f["seq_len"].value = 64
    f["sequence_parallel"].value = False
    f["dp"].value, f["tp"].value, f["pp"].value = 1, 1, 4
    f["pp_schedule"].value = "interleaved-1f1b"
    f["virtual_stages"].value = 1
    assert "needs virtual_stages(1) >= 2" in shown(msgs)
    f["virtual_stages"].value = 2
    assert "pipeline stages pp(4) * virtual_stages(2) = 8" in shown(msgs)  # tiny-llama has 4 layers
    f["pp"].value, f["dp"].value, f["pp_schedule"].value = 1, 4, "1f1b"
    f["batch_size"].value = 3
    assert "batch_size(3) is not divisible" in shown(msgs)
    f["batch_size"].value = 8
    assert "cannot run" not in shown(msgs) and "ranks 0-3:" in shown(p.plan_section.prediction)
    assert s.calls == []  # nothing ran


@pytest.mark.pure
def test_plan_section_draws_the_mesh_of_the_plan_being_edited():
    s = FakeSession()
    p = Panel(s)
    f, mesh = p.plan_section.fields, p.plan_section.dry.mesh
    f["dp"].value, f["tp"].value = 2, 2
    assert "4 ranks (dp 2 x tp 2)" in mesh.layout.title.text and "(predicted)" in mesh.layout.title.text
    assert sum(v is not None for row in mesh.data[0].z for v in row) == 4  # a cell per rank
    assert "rank 3: dp1 tp1" in mesh.data[0].customdata[0][3] and "predicted:" in mesh.data[0].customdata[0][3]
    f["tp"].value = 3  # cannot run: no mesh
    assert "no mesh" in mesh.layout.annotations[0].text
    assert s.calls == []


@pytest.mark.pure
def test_the_mesh_of_the_applied_plan_shows_what_the_ranks_measured():
    s, p = laid_out()
    p.train(2).wait(5)
    p.notify(JobEnded(JobKind.TRAIN))
    mesh = p.plan_section.dry.mesh
    assert "(live)" in mesh.layout.title.text and "measured:" in mesh.data[0].customdata[0][1]
    assert [t.name.split(":")[0] for t in mesh.data[1:]] == ["dp"]  # the fake's all_reduce per step


@pytest.mark.pure
def test_dry_run_mode_lets_the_world_exceed_the_ranks_and_the_views_draw_its_records():
    s, p = laid_out()
    section, views = p.plan_section, p.views
    dry = section.dry
    section.fields["batch_size"].value = 16
    section.fields["dp"].value = 16  # the session has 4 ranks
    assert "= 16 != ranks(4)" in shown(section.messages) and dry.run.disabled
    dry.switch.value = True
    assert "cannot run" not in shown(section.messages) and "16 virtual ranks (dry run)" in shown(section.messages)
    assert section.apply.disabled and not dry.run.disabled
    dry.run.click()
    assert ("dry_run", Plan(dp=16, batch_size=16)) in s.calls and "dry run: tiny-llama dp16 on 16 virtual ranks" in shown(dry.status)
    assert "(dry run)" in dry.mesh.layout.title.text and [t.name for t in dry.mesh.data[1:]] == ["dp: 1 KiB/rank"]
    views.tab.selected_index = 1  # memory: the dry run's records, labelled so
    assert views.memory.layout.title.text.endswith("(dry run)") and len(views.memory.data[0].x) == 16
    assert "dry run: tiny-llama" in shown(views.messages["memory"])
    views.tab.selected_index = 2
    assert views.comm_breakdown.layout.title.text.endswith("(dry run)") and "no timeline" in shown(views.messages["communication"])
    tree = views.comm_tree  # every one of the 16 virtual ranks' all_reduce, summed
    assert tree.layout.title.text.endswith("(dry run)") and tree.data[0].customdata[0][0] == 16
    views.tab.selected_index = 3
    assert views.param.options == ("lm_head.weight", "model.embed_tokens.weight")
    assert views.sharding.layout.title.text.endswith("(dry run)")
    assert ("layout",) not in s.calls  # the live ranks were not asked
    dry.switch.value = False  # back to the live ranks: their problem, their records
    assert "= 16 != ranks(4)" in shown(section.messages) and not section.apply.disabled
    views.tab.selected_index = 1
    assert not views.memory.layout.title.text.endswith("(dry run)")


def click(figure: go.FigureWidget, trace: int) -> None:
    """A click on `trace` as plotly's front end reports one (the FigureWidget dispatches it)."""
    figure._handler_js2py_pointsCallback({"new": {
        "event_type": "plotly_click", "selector": None, "device_state": None,
        "points": {"trace_indexes": [trace], "point_indexes": [0], "xs": [0.0], "ys": [0.0]}}})


@pytest.mark.pure
def test_a_click_on_a_block_of_the_layout_map_fetches_it_from_its_rank():
    s, p = laid_out()
    views = p.views
    views.tab.selected_index = 3
    assert "click a block" in shown(views.peek.html) and "fetch" not in names(s)
    click(views.sharding, 0)
    assert [c for c in s.calls if c[0] == "fetch"] == [("fetch", "lm_head.weight", 0, False, "param")]
    text = " ".join(shown(views.peek.html).split())
    assert "parameter lm_head.weight" in text and "rank 0 (the same block on ranks 0, 1, 2, 3)" in text, text
    assert "shape (128, 64)" in text and "dtype float32" in text and "index [0:128, 0:64] of (128, 64)" in text
    assert "min 0 max 81.91 mean 40.955" in text and "0 0.01 0.02 0.03 ..." in text  # the fake's values
    views.param.value = "model.embed_tokens.weight"  # redrawn: its traces answer clicks too
    assert "click a block" in shown(views.peek.html)
    click(views.sharding, 0)
    assert s.calls[-1] == ("fetch", "model.embed_tokens.weight", 0, False, "param")


@pytest.mark.pure
def test_each_button_calls_the_session_and_shows_its_result():
    s = FakeSession()
    p = Panel(s)
    p.plan_section.load.click()
    assert asked(s)[-1] == ("load_model", "tiny-llama") and "(loaded)" in p.plan_section.messages.value
    p.plan_section.apply.click()
    assert actions(s)[-1] == "apply" and asked(s)[-1][1].dp == 4 and "applied" in p.plan_section.messages.value
    p.plan_section.fields["lr"].value = 2e-3
    p.train(3)
    assert p.wait(10)
    assert asked(s)[-1] == ("train", 3, dict(batch_size=8, seq_len=64, grad_accum=1, lr=2e-3, precision="fp32",
                                                max_grad_norm=0.0))
    assert p.run_section.progress.value == 3 and "done: 3 steps" in p.run_section.status.value
    loss = p.views.loss
    assert [t.name for t in loss.data] == ["rank 0", "rank 1", "rank 2", "rank 3", "mean"]
    assert all(len(t.x) == 3 for t in loss.data) and not loss.layout.annotations
    p.run_section.do_sample.value = True
    p.run_section.temperature.value, p.run_section.top_k.value = 0.7, 5
    p.generate("abc\nxyz")
    assert p.wait(10)
    assert asked(s)[-1] == ("generate", ["abc", "xyz"], 16, dict(do_sample=True, temperature=0.7, top_k=5))
    assert "cbacbacba" in p.run_section.generate_out.value and "<b>xyz</b>" in p.run_section.generate_out.value
    p.run_section.verify.click()
    out = p.run_section.verify_out.value
    assert "ip-ok" in out and ">OK<" in out and "lm_head.weight" in out and "128x64" in out
    p.run_section.save.click()
    assert "saved checkpoint to /abs/ckpt" in p.run_section.files_out.value
    p.run_section.load.click()
    assert "loaded checkpoint from /abs/ckpt" in p.run_section.files_out.value
    p.run_section.export.click()
    assert actions(s)[-3:] == ["save", "load", "export_script"] and "train_script.py" in p.run_section.files_out.value
    p.cluster.doctor.click()
    assert "every rank met" in p.cluster.doctor_out.value and "1.50" in p.cluster.doctor_out.value
    assert p.error_text == ""
    assert not any(re.search(r"color:\s*#", w.value) for w in every_widget(p) if isinstance(w, W.HTML)), \
        "a fixed colour vanishes in one of the themes: use the --jp-* variables (render.STYLE)"


@pytest.mark.pure
def test_verify_shows_a_mismatch_per_parameter():
    s, p = laid_out(verify_ok=False)
    p.run_section.verify.click()
    out = p.run_section.verify_out.value
    assert "MISMATCH" in out and "ip-bad" in out and out.count("over") == 2 and p.error_text == ""


@pytest.mark.pure
def test_every_figure_follows_the_steps_while_training_runs():
    s, p = laid_out(step_delay=0.15)
    v = p.views
    v.live_interval = 0.0
    v.tab.selected_index = 2  # communication
    job = p.train(8)
    assert until(lambda: len(v.loss.data) == 5 and len(v.loss.data[0].x) >= 3)
    assert not job.done  # still training: what follows was drawn during the run
    assert v.comm_matrix.data and len(v.timeline.data) == 1
    tree = v.comm_tree.data[0]  # why: each rank's bucket all-reduce, under the DDP bucket that issued it
    assert list(tree.ids) == ["all collectives", "ddp bucket 0", "ddp bucket 0 / bucket all-reduce",
                              "ddp bucket 0 / bucket all-reduce / all_reduce on dp"] and tree.values[0] == 4 * 460_000
    v.tab.selected_index = 1  # memory: drawn at once from what the session holds
    measured = [t.name for t in v.memory.data if "predicted" not in t.name]
    assert measured == ["params", "grads", "optimizer", "activations"]
    assert any("predicted" in t.name for t in v.memory.data) and ("predict_memory", None) in s.calls
    v.tab.selected_index = 3  # layout: a remote call, not made while the ranks are busy
    assert "layout" not in names(s) and "not busy" in v.messages["layout"].value
    done_at_switch = p.run_section.progress.value
    assert p.wait(10)
    assert p.run_section.progress.value == 8 > done_at_switch
    assert names(s).count("layout") == 1 and v.param.options == ("lm_head.weight", "model.embed_tokens.weight")
    v.tab.selected_index = 0
    v.tab.selected_index = 3
    assert names(s).count("layout") == 1  # read once per plan
    p.plan_section.fields["pp"].value, p.plan_section.fields["dp"].value = 2, 2
    p.plan_section.fields["microbatches"].value = 2
    p.plan_section.apply.click()
    assert names(s).count("layout") == 2  # a new plan: read again
    p.train(2)
    assert p.wait(10)
    v.tab.selected_index = 4
    assert len(v.pipeline.data) == 2 and "bubble" in v.pipeline.layout.title.text


@pytest.mark.pure
def test_generate_streams_tokens_and_stop_ends_it():
    s, p = laid_out(token_delay=0.05)
    job = p.generate("abc")
    r = p.run_section
    assert until(lambda: r.progress.value >= 3)
    partial = r.generate_out.value
    assert "<b>abc</b>" in partial and "cba" in partial and "▌" in partial  # growing, not yet done
    assert not r.interrupt.disabled and r.generate.disabled and r.train.disabled
    r.interrupt.click()
    assert job.wait(5) and ("interrupt",) in s.calls
    assert "stopped after" in r.status.value and r.progress.value < 16 and "▌" not in r.generate_out.value
    assert not r.generate.disabled and r.interrupt.disabled and p.error_text == ""


@pytest.mark.pure
def test_serve_streams_each_request_and_the_views_draw_requests_and_steps():
    s, p = laid_out(token_delay=0.02)
    p.run_section.prompts.value = "ab\ncde"
    p.run_section.do_sample.value = True
    p.run_section.temperature.value = 0.5
    job = p.serve(5, max_tokens=8, policy="static", max_batch=2)
    sv = p.serve_section
    assert until(lambda: "decoding" in sv.serve_out.value)
    assert sv.serve.disabled and not p.run_section.interrupt.disabled  # busy: Stop is the only way out
    assert job.wait(10) and p.error_text == ""
    call = next(c for c in s.calls if c[0] == "serve")
    assert call[1] == ["r0", "r1", "r2", "r3", "r4"] and call[2] == dict(engine="auto", policy="static", max_batch=2)
    out = shown(sv.serve_out)
    assert "r4" in out and "done (length)" in out and "dcedc" in out  # each request's text, streamed then done
    assert "served 5 requests" in p.run_section.status.value and not sv.serve.disabled
    v = p.views
    v.tab.selected_index = 6
    assert len(v.request_timeline.data[0].y) == 5 and "policy static" in v.messages["requests"].value
    v.tab.selected_index = 5
    assert v.tokens_per_step.data and v.kv_memory.data and v.step_split.data


@pytest.mark.pure
def test_quantize_and_full_precision_buttons_and_their_view():
    s, p = laid_out()
    p.quantize("int4-weight-only")
    sv, v = p.serve_section, p.views
    assert ("quantize", "int4-weight-only") in s.calls and "int4-weight-only" in sv.quantize_out.value
    assert "1.06 MiB" in sv.quantize_out.value and p.error_text == ""
    v.tab.selected_index = 7
    assert "int4-weight-only" in v.quantization.layout.title.text
    sv.dequantize.click()
    assert ("dequantize",) in s.calls and "full precision" in sv.quantize_out.value
    assert "full precision" in v.messages["quantization"].value
    p.plan_section.fields["dp"].value, p.plan_section.fields["fsdp"].value = 1, 4
    p.plan_section.apply.click()
    p.quantize("int8-weight-only")
    assert "plan fsdp4: FSDP gathers" in p.error_text  # refused, shown, nothing quantized
    assert not sv.quantize.disabled


@pytest.mark.pure
def test_a_rank_failure_names_the_rank_and_controls_come_back():
    s, p = laid_out(fail_step=1)

    def refuses():
        raise ValueError("rank two refuses")

    assert p.run(refuses) is None
    assert "rank 2 (hostA) raised ValueError" in p.error_text and "Traceback" in p.error_text
    p.train(3)
    assert p.wait(10)
    assert "train failed: rank 1 (hostA) raised RuntimeError" in p.error_text and "boom" in p.error_text
    assert p.run_section.progress.value == 1 and p.run_section.progress.bar_style == "danger"
    assert not p.run_section.train.disabled and not p.plan_section.apply.disabled
    assert p.run_section.interrupt.disabled and p.activity == ""
    p.plan_section.apply.click()  # still usable
    assert actions(s)[-1] == "apply"
    p.run_section.verify.click()
    assert p.error_text == "" and "OK" in p.run_section.verify_out.value


@pytest.mark.pure
def test_refusals_before_anything_runs_are_shown():
    p = Panel(FakeSession())
    p.run_section.verify.click()
    assert "verify failed: SessionError: no model laid out" in p.error_text
    p.generate("")
    assert p.wait(5)
    assert "no model loaded" in p.error_text and not p.run_section.generate.disabled


@pytest.mark.pure
def test_stop_interrupts_training_and_controls_are_frozen_meanwhile():
    s, p = laid_out(step_delay=0.05)
    job = p.train(200)
    assert until(lambda: p.run_section.progress.value >= 2)
    assert p.run_section.train.disabled and p.plan_section.apply.disabled and p.cluster.stop.disabled
    assert not p.run_section.interrupt.disabled and "training" in p.cluster.status.value
    p.run_section.interrupt.click()
    assert job.wait(5)
    assert ("interrupt",) in s.calls and 2 <= p.run_section.progress.value < 200
    assert "stopped after" in p.run_section.status.value and "of 200 steps" in p.run_section.status.value
    assert not p.run_section.train.disabled and p.run_section.interrupt.disabled and p.error_text == ""


@pytest.mark.pure
def test_where_are_the_ranks_shows_each_ranks_stack_while_training_runs():
    s, p = laid_out(step_delay=0.05)
    where = p.run_section.jobs.where
    assert not where.disabled  # a live session, no job: asking is allowed
    assert p.run_section.jobs.where_box.layout.display == "none"  # no lanes before the first question
    job = p.train(200)
    assert until(lambda: p.run_section.progress.value >= 2)
    assert not where.disabled and p.run_section.train.disabled  # live while every action control is frozen
    asked = p.run_section.jobs.show_stacks()
    assert asked.wait(5) and asked.error is None
    shown = p.run_section.jobs.where_out.value
    assert "rank 0</b>: in all_reduce" in shown and "model.layers.0.mlp" in shown and "ip-model" in shown
    assert "ip-own" in shown and "rank 3</b>: did not answer within 2 s" in shown
    lanes = p.run_section.jobs.where_lanes  # beside the stacks: the world's lanes, rank 1 short of #58
    assert p.run_section.jobs.where_box.layout.display == "" and ("collectives", 20, 2.0) in s.calls
    assert [a.text for a in lanes.layout.annotations] == ["rank(s) [1] never issued #58"]
    assert sorted(set(lanes.data[0].y)) == ["rank 0", "rank 1", "rank 2"] and max(lanes.data[0].x) == 58
    p.run_section.interrupt.click()
    assert job.wait(5) and ("stacks", False, 2.0) in s.calls
    where.click()
    assert until(lambda: "rank 0</b>: idle" in p.run_section.jobs.where_out.value)


@pytest.mark.pure
def test_without_a_session_the_cluster_section_starts_one(monkeypatch):
    import interactive_parallel.cluster as cluster_pkg

    p = ip.panel()  # nothing started yet
    assert isinstance(p, Panel) and p.session is None
    assert not p.cluster.start.disabled and p.cluster.stop.disabled and p.run_section.train.disabled
    p.run_section.generate.click()
    assert "no session: start one" in p.error_text
    started = []

    def fake_session(ranks, device):
        started.append((ranks, device))
        return FakeSession(world=ranks)

    monkeypatch.setattr(cluster_pkg, "Session", fake_session)
    p.cluster.ranks.value = 2
    assert "!= ranks(2)" in p.plan_section.messages.value  # the picked plan was for 4
    p.cluster.start.click()
    assert started == [(2, "cpu")] and p.session is not None and not p.run_section.train.disabled
    assert p.cluster.start.disabled and "hostA" in p.cluster.status.value
    s = p.session
    s.stop()  # stopped from a cell: the panel follows session.alive
    assert not p.alive
    p.set_session(s)
    assert p.run_section.train.disabled and not p.cluster.start.disabled
    p.cluster.start.click()
    s2 = p.session
    p.cluster.stop.click()
    assert names(s2)[-1] == "stop" and p.session is None and not p.cluster.start.disabled


@pytest.mark.pure
def test_refresh_copies_a_new_figure_into_the_live_widget():
    w = go.FigureWidget(loss_figure(None))
    assert w.layout.annotations and w.layout.xaxis.showticklabels is False
    steps = [StepRecord(rank=r, step=s, loss=1.0 + r, tokens=1, time_s=1.0) for r in range(2) for s in range(2)]
    refresh(w, loss_figure(steps))
    assert len(w.data) == 3 and not w.layout.annotations and w.layout.xaxis.showticklabels is None
    first = w.data[0]
    steps.append(StepRecord(rank=0, step=2, loss=0.5, tokens=1, time_s=1.0))
    refresh(w, loss_figure(steps))
    assert w.data[0] is first and list(first.x) == [0, 1, 2]  # same trace, updated in place
    refresh(w, loss_figure(None))
    assert not w.data and w.layout.annotations
    assert pruned(w.to_plotly_json()["layout"]) == pruned(go.FigureWidget(loss_figure(None)).to_plotly_json()["layout"])


def pruned(d):
    """A layout without empty containers (a reset leaf may leave its parent as {})."""
    if isinstance(d, dict):
        out = {k: pruned(v) for k, v in d.items()}
        return {k: v for k, v in out.items() if v != {}}
    return d


# ---- against a live session ---------------------------------------------------------------------
def _fails_on_rank_three():
    from interactive_parallel.runtime.rank import state

    if state.get().rank == 3:
        raise ValueError("rank three refuses")
    return state.get().rank


@pytest.mark.session
def test_panel_drives_a_live_session(session4):
    s = session4
    s.load_model("tiny-llama")
    p = ip.panel(s)
    assert p.session is s and p.alive and "(loaded)" in p.plan_section.messages.value
    p.plan_section.fields["dp"].value = 4
    p.plan_section.apply.click()
    assert p.error_text == "", p.error_text
    assert s.plan.dp == 4
    p.views.live_interval = 0.0
    p.views.tab.selected_index = 2
    t0 = time.monotonic()
    p.train(3)
    assert p.wait(120), "training did not finish"
    print(f"3 steps through the panel: {time.monotonic() - t0:.1f} s")
    assert p.error_text == "", p.error_text
    assert sorted(t.name for t in p.views.loss.data) == ["mean", "rank 0", "rank 1", "rank 2", "rank 3"]
    assert all(len(t.x) == 3 for t in p.views.loss.data) and p.views.comm_matrix.data
    tree = p.views.comm_tree.data[0]  # the latest step's DDP buckets, named by the ranks' tracing
    assert tree.values[0] > 0 and any(i.startswith("ddp bucket") for i in tree.ids), list(tree.ids)
    assert list(tree.ids[1:]) == [n.path for n in s.explain_comms()]
    tokens = []
    r = p.run_section
    real_on_token = r._on_token
    r._on_token = lambda rec: (tokens.append(rec), real_on_token(rec))
    p.generate("12+35=")
    assert p.wait(60)
    assert p.error_text == "" and "<b>12+35=</b>" in r.generate_out.value and len(tokens) == 16
    assert r.status.value == "generated"
    r.max_tokens.value = 200
    job = p.generate("7+8=")
    assert until(lambda: r.progress.value >= 2, 60)
    r.interrupt.click()
    assert job.wait(60) and p.error_text == "", p.error_text
    assert "stopped after" in r.status.value and r.progress.value < 200 and not r.generate.disabled
    r.verify.click()
    assert p.error_text == "" and ">OK<" in r.verify_out.value, r.verify_out.value
    for tab in (1, 3, 4):
        p.views.tab.selected_index = tab
    assert p.views.memory.data and p.views.sharding.data and "failed" not in str(
        [m.value for m in p.views.messages.values()])
    # a click on a block of the layout map (as plotly's front end reports one) fetches it from its rank
    click(p.views.sharding, 0)
    peek = " ".join(shown(p.views.peek.html).split())
    param = p.views.param.value
    assert f"parameter {param}" in peek and "rank 0 (the same block on ranks 0, 1, 2, 3)" in peek, peek
    assert all(f" {k} " in peek for k in ("norm", "min", "max", "mean", "float32")), peek
    block = s.fetch(param, 0)  # what the panel showed: its shape, its norm, its first value
    first = block.tensor.reshape(-1)[0].item()
    assert str(block.shape) in peek and f"{block.stats()['norm']:.6g}" in peek and f"{first:.4g}" in peek, peek
    # the fake answers with the types this live session answers with
    for name in ("memory", "comms", "timeline", "layout", "predict_memory", "doctor"):
        got = getattr(s, name)()
        assert isinstance(got, RecordList) and got and {type(x) for x in got} <= set(ELEMENTS[name]), name
    assert isinstance(s.verify(), VerifyReport)
    job = p.serve(6, gap=0.02, max_tokens=6)
    assert job.wait(120) and p.error_text == "", p.error_text
    assert "served 6 requests" in r.status.value and s.served().engine == "transformers"
    p.views.tab.selected_index = 6
    assert len(p.views.request_timeline.data[0].y) == 6 and "failed" not in p.views.messages["requests"].value
    p.quantize("int8-weight-only")
    assert p.error_text == "" and "int8-weight-only" in p.serve_section.quantize_out.value, p.error_text
    for name in ("decoding", "quantized"):
        got = getattr(s, name)()
        assert isinstance(got, RecordList) and got and {type(x) for x in got} <= set(ELEMENTS[name]), name
    p.serve_section.dequantize.click()
    assert p.error_text == "" and s.quantization is None
    assert p.run(_fails_on_rank_three) is None
    assert "rank 3" in p.error_text and "rank three refuses" in p.error_text
    assert p.run(lambda: 7) == [7] * 4 and not r.generate.disabled
    asked = p.run_section.jobs.show_stacks()  # "Where are the ranks?": answered by the live ranks' control threads
    assert asked.wait(10) and asked.error is None, asked.error
    assert all(f"rank {k}</b>: idle" in p.run_section.jobs.where_out.value for k in range(4))
    lanes = p.run_section.jobs.where_lanes  # the ranks agree (nothing marked), each has a lane
    assert not lanes.layout.shapes and {y for t in lanes.data for y in t.y} == {f"rank {k}" for k in range(4)}
