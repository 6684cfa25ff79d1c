"""The control panel (widgets/) without a browser: built against a fake session that records
calls (pure), and against a live 4-rank Session (session). Clicks are `button.click()`; training
runs as the panel's Job in a thread here (no kernel loop), so tests `wait()` for it."""
from __future__ import annotations

import asyncio
import threading
import time

import plotly.graph_objects as go
import pytest

from interactive_parallel.cluster.errors import RankError
from interactive_parallel.plan import Plan, check, resolve_model
from interactive_parallel.records import (CommRecord, MemoryRecord, PipelineEvent, RankInfo, RecordList, ShardRecord,
                                          StepRecord)
from interactive_parallel.viz import loss_figure
from interactive_parallel.widgets import Panel, panel
from interactive_parallel.widgets import cluster as cluster_mod
from interactive_parallel.widgets._common import refresh

WORLD = 4


class FakeSession:
    """Stands in for Session: the public methods the panel calls, each recorded in `calls`."""

    device = "cpu"
    world_size = WORLD

    def __init__(self, fail_step: int | None = None, step_delay: float = 0.0):
        self.calls: list[tuple] = []
        self.spec = None
        self.plan: Plan | None = None
        self.history = RecordList()
        self.ranks_info = [dict(rank=r, host="hostA", pid=1000 + r, local_rank=r, cuda=0) for r in range(WORLD)]
        self._interrupt = threading.Event()
        self.fail_step, self.step_delay = fail_step, step_delay

    def check_plan(self, plan):
        return check(plan, WORLD, self.spec)

    def load_model(self, model):
        self.calls.append(("load_model", model))
        self.spec = resolve_model(model)

    def apply(self, plan):
        self.calls.append(("apply", plan))
        self.check_plan(plan)
        self.plan = plan

    async def train_async(self, steps, *, on_step=None, **knobs):
        self.calls.append(("train", steps, knobs))
        self._interrupt.clear()
        out = []
        start = len({r.step for r in self.history})
        for i in range(steps):
            if self._interrupt.is_set():
                break
            await asyncio.sleep(self.step_delay)
            if self.fail_step == i:
                raise RankError(1, "RuntimeError", "step exploded", "Traceback (most recent call last):\n  boom",
                                host="hostA", what="train_step")
            recs = [StepRecord(rank=r, step=start + i, loss=5.0 - 0.1 * i + 0.01 * r, tokens=128, time_s=0.01,
                               plan="dp4") for r in range(WORLD)]
            self.history.extend(recs)
            out.extend(recs)
            if on_step:
                on_step(recs)
        return out

    def interrupt(self):
        self.calls.append(("interrupt",))
        self._interrupt.set()

    def generate(self, prompts, max_new_tokens=16, **kw):
        self.calls.append(("generate", list(prompts), max_new_tokens, kw))
        return [f" and then {p[::-1]}" for p in prompts]

    def doctor(self):
        self.calls.append(("doctor",))
        return RecordList([RankInfo(rank=r, engine_id=r, host="hostA", pid=1000 + r, local_rank=r, device="cpu",
                                    backend="gloo", threads=1, torch="2.x", transformers="5.x", world_size=WORLD,
                                    barrier_ok=True, all_reduce_ok=True) for r in range(WORLD)],
                          columns=("rank", "host", "pid", "backend", "all_reduce_ok"))

    def verify(self):
        self.calls.append(("verify",))
        return {"ok": True, "dloss": 1e-7, "params": [{"name": "lm_head.weight", "max_abs_diff": 2e-8}]}

    def save(self, path):
        self.calls.append(("save", path))

    def load(self, path):
        self.calls.append(("load", path))

    def export_script(self, path):
        self.calls.append(("export_script", path))
        return path

    def memory(self):
        self.calls.append(("memory",))
        return [MemoryRecord(rank=r, step=0, params=460_000, grads=460_000, optimizer=920_000, activations=10_000)
                for r in range(WORLD)]

    def comms(self):
        self.calls.append(("comms",))
        return [CommRecord(rank=r, step=0, op="all_reduce", bytes=460_000, axis="dp", group=list(range(WORLD)),
                           start=1.0 + r * 0.001, end=1.01 + r * 0.001) for r in range(WORLD)]

    def layout(self):
        self.calls.append(("layout",))
        return [ShardRecord(param=name, rank=r, global_shape=[8, 4], local_shape=[8, 4], placements=["Replicate()"],
                            mesh_axes=["dp"], coords={"dp": r}, index=[[0, 8], [0, 4]])
                for name in ("lm_head.weight", "model.embed_tokens.weight") for r in range(WORLD)]

    def timeline(self):
        self.calls.append(("timeline",))
        return self.comms() + [PipelineEvent(rank=r, step=0, stage=r, microbatch=0, action="F", start=1.0 + r,
                                             end=1.5 + r) for r in range(WORLD)]

    def run(self, fn, *args, **kwargs):
        self.calls.append(("run", fn))
        raise RankError(2, "ValueError", "rank two refuses", "Traceback (most recent call last):\n  ValueError",
                        host="hostA", what=getattr(fn, "__name__", "run"))

    def stop(self):
        self.calls.append(("stop",))


class OlderSession(FakeSession):
    """A Session without the methods other work is adding (verify, memory, ...)."""

    verify = save = load = export_script = memory = comms = layout = timeline = None


def names(session) -> list[str]:
    return [c[0] for c in session.calls]


def all_widgets(w) -> list:
    out = [w]
    for child in getattr(w, "children", ()) or ():
        out += all_widgets(child)
    return out


def classes(p: Panel) -> set[str]:
    return {c for w in all_widgets(p) for c in getattr(w, "_dom_classes", ())}


@pytest.fixture(autouse=True)
def _no_torch(monkeypatch):
    # The no-session path asks torch about GPUs; pure tests need no torch import.
    monkeypatch.setattr(cluster_mod, "cuda_unavailable_reason", lambda session=None: "no GPU (test)")


@pytest.mark.pure
def test_panel_builds_with_a_css_class_on_every_control_and_figure():
    p = Panel(FakeSession())
    expected = {"ip-panel", "ip-error-output", "ip-device", "ip-ranks", "ip-start-button", "ip-attach-button",
                "ip-stop-cluster-button", "ip-doctor-button", "ip-rank-status", "ip-model-preset", "ip-model-path",
                "ip-load-model-button", "ip-dp", "ip-fsdp", "ip-tp", "ip-pp", "ip-cp", "ip-pp-schedule",
                "ip-microbatches", "ip-batch-size", "ip-seq-len", "ip-grad-accum", "ip-precision", "ip-lr",
                "ip-plan-messages", "ip-memory-prediction", "ip-apply-button", "ip-train-steps", "ip-train-button",
                "ip-interrupt-button", "ip-train-progress", "ip-prompts", "ip-max-tokens", "ip-do-sample",
                "ip-generate-button", "ip-generate-output", "ip-verify-button", "ip-save-button",
                "ip-load-checkpoint-button", "ip-export-button", "ip-views", "ip-loss-figure", "ip-memory-figure",
                "ip-comm-matrix-figure", "ip-comm-breakdown-figure", "ip-timeline-figure", "ip-layout-param",
                "ip-sharding-figure", "ip-pipeline-figure"}
    assert expected <= classes(p), sorted(expected - classes(p))
    figures = [w for w in all_widgets(p) if isinstance(w, go.FigureWidget)]
    assert len(figures) == 7
    assert "hostA" in p.cluster.status.value and "1003" in p.cluster.status.value
    # device: cuda is not offered, and the panel says why
    assert p.cluster.device.options == ("cpu",) and "no GPU" in p.cluster.device_note.value
    # a live session: Start/Attach off, Stop on; Stop (interrupt) only while training
    assert p.cluster.start.disabled and not p.cluster.stop.disabled and p.run_section.interrupt.disabled
    assert panel(FakeSession()).session is not None


@pytest.mark.pure
def test_validation_messages_follow_the_pickers_before_anything_runs():
    s = FakeSession()
    p = Panel(s)
    msgs = p.plan_section.messages
    assert "fits 4 ranks" in msgs.value
    p.plan_section.degrees["dp"].value = 2
    p.plan_section.degrees["tp"].value = 3
    assert "= 6 != ranks(4)" in msgs.value and "tp(3) does not divide num_attention_heads(4)" in msgs.value
    p.plan_section.degrees["tp"].value = 1
    p.plan_section.batch_size.value = 3
    assert "batch_size(3) is not divisible" in msgs.value and "= 6" not in msgs.value
    p.plan_section.batch_size.value = 8
    p.plan_section.degrees["dp"].value = 4
    assert "cannot run" not in msgs.value
    assert s.calls == []  # nothing ran


@pytest.mark.pure
def test_memory_prediction_uses_the_estimate_when_present(monkeypatch):
    import sys
    import types

    p = Panel(FakeSession())
    est = types.ModuleType("interactive_parallel.plan.estimate")
    est.predict_memory = lambda spec, plan: [MemoryRecord(rank=r, step=-1, params=1024 ** 2, grads=1024 ** 2,
                                                          optimizer=2 * 1024 ** 2) for r in range(plan.world_size)]
    monkeypatch.setitem(sys.modules, "interactive_parallel.plan.estimate", est)
    p.plan_section.lr.value = 2e-3
    assert "ranks 0, 1, 2, 3: 4 MiB" in p.plan_section.prediction.value
    monkeypatch.setitem(sys.modules, "interactive_parallel.plan.estimate", None)  # import fails
    p.plan_section.lr.value = 3e-3
    assert "prediction unavailable" in p.plan_section.prediction.value


@pytest.mark.pure
def test_each_button_calls_the_session_and_updates_its_view():
    s = FakeSession()
    p = Panel(s)
    p.plan_section.load.click()
    assert s.calls[-1] == ("load_model", "tiny-llama") and "(loaded)" in p.plan_section.messages.value
    p.plan_section.apply.click()
    assert names(s)[-1] == "apply" and s.calls[-1][1].dp == 4 and "applied" in p.plan_section.messages.value
    p.run_section.steps.value = 3
    p.run_section.train.click()
    assert p.wait(10)
    assert s.calls[-1][:2] == ("train", 3) and s.calls[-1][2]["lr"] == 1e-3
    assert p.run_section.progress.value == 3 and "done: 3 steps" in p.run_section.train_status.value
    loss = p.views.loss
    assert [t.name for t in loss.data] == ["rank 0", "rank 1", "rank 2", "rank 3", "mean"]
    assert all(len(t.x) == 3 for t in loss.data) and not loss.layout.annotations
    p.run_section.prompts.value = "abc\nxyz"
    p.run_section.generate.click()
    assert s.calls[-1][:2] == ("generate", ["abc", "xyz"]) and "and then cba" in p.run_section.generate_out.value
    p.run_section.verify.click()
    assert "ok" in p.run_section.verify_out.value and "lm_head.weight" in p.run_section.verify_out.value
    p.run_section.save.click()
    p.run_section.load.click()
    p.run_section.export.click()
    assert names(s)[-3:] == ["save", "load", "export_script"] and "train_script.py" in p.run_section.files_out.value
    p.cluster.doctor.click()
    assert "all_reduce_ok" in p.cluster.doctor_out.value
    assert p.error_text == ""


@pytest.mark.pure
def test_tabs_draw_from_the_session_when_opened():
    s = FakeSession()
    p = Panel(s)
    s.load_model("tiny-llama")
    v = p.views
    v.tab.selected_index = 1
    assert "memory" in names(s)
    measured = [t.name for t in v.memory.data if "predicted" not in t.name]
    predicted = [t.name for t in v.memory.data if "predicted" in t.name]
    assert measured == ["params", "grads", "optimizer", "activations"]
    # beside the prediction when plan.estimate exists, else the tab says why there is none
    assert len(predicted) == 4 or "prediction unavailable" in v.messages["memory"].value
    v.tab.selected_index = 2
    assert {"comms", "timeline"} <= set(names(s))
    assert len(v.comm_matrix.data) == 1 and len(v.comm_breakdown.data) == 1 and len(v.timeline.data) == 2
    v.tab.selected_index = 3
    assert v.param.options == ("lm_head.weight", "model.embed_tokens.weight")
    assert v.sharding.data and "Sharding of lm_head.weight" in v.sharding.layout.title.text
    v.param.value = "model.embed_tokens.weight"
    assert "embed_tokens" in v.sharding.layout.title.text and "Replicate()" in v.layout_table.value
    v.tab.selected_index = 4
    assert len(v.pipeline.data) == 1 and "bubble" in v.pipeline.layout.title.text


@pytest.mark.pure
def test_methods_this_session_lacks_are_named_not_faked():
    s = OlderSession()
    p = Panel(s)
    p.run_section.verify.click()
    assert "has no verify() method" in p.error_text
    p.run_section.export.click()
    assert "has no export_script() method" in p.error_text
    p.views.tab.selected_index = 1
    assert "has no memory() method" in p.views.messages["memory"].value
    p.views.tab.selected_index = 3
    assert "has no layout() method" in p.views.messages["layout"].value
    assert not p.run_section.verify.disabled  # re-enabled after the failure


@pytest.mark.pure
def test_a_rank_failure_names_the_rank_and_controls_come_back():
    s = FakeSession(fail_step=1)
    p = Panel(s)
    assert p.run(lambda: 1 / 0) is None
    assert "rank 2 (hostA) raised ValueError" in p.error_text and "Traceback" in p.error_text
    p.train(3)
    assert p.wait(10)
    assert "train failed: rank 1 (hostA) raised RuntimeError" in p.error_text and "boom" in p.error_text
    assert p.run_section.progress.value == 1 and p.run_section.progress.bar_style == "danger"
    assert not p.run_section.train.disabled and not p.plan_section.apply.disabled
    assert p.run_section.interrupt.disabled and p.activity == ""
    p.plan_section.apply.click()  # still usable
    assert names(s)[-1] == "apply"


@pytest.mark.pure
def test_stop_interrupts_training_and_controls_are_frozen_meanwhile():
    s = FakeSession(step_delay=0.05)
    p = Panel(s)
    job = p.train(200)
    deadline = time.monotonic() + 5
    while p.run_section.progress.value < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.run_section.train.disabled and p.plan_section.apply.disabled and p.cluster.stop.disabled
    assert not p.run_section.interrupt.disabled and "training" in p.cluster.status.value
    p.run_section.interrupt.click()
    assert job.wait(5)
    assert ("interrupt",) in s.calls and 2 <= p.run_section.progress.value < 200
    assert not p.run_section.train.disabled and p.run_section.interrupt.disabled


@pytest.mark.pure
def test_without_a_session_the_cluster_section_starts_one(monkeypatch):
    from interactive_parallel import Session
    import interactive_parallel.cluster as cluster_pkg

    p = Session.panel()  # on the class: nothing started yet
    assert isinstance(p, Panel) and p.session is None
    assert not p.cluster.start.disabled and p.cluster.stop.disabled and p.run_section.train.disabled
    p.run_section.generate.click()
    assert "no session: start one" in p.error_text
    started = []

    def fake_session(ranks, device):
        started.append((ranks, device))
        return FakeSession()

    monkeypatch.setattr(cluster_pkg, "Session", fake_session)
    p.cluster.ranks.value = 4
    p.cluster.start.click()
    assert started == [(4, "cpu")] and p.session is not None and not p.run_section.train.disabled
    assert p.cluster.start.disabled and "hostA" in p.cluster.status.value
    s = p.session
    p.cluster.stop.click()
    assert names(s)[-1] == "stop" and p.session is None and not p.cluster.start.disabled


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
    from interactive_parallel.runtime import state

    if state.get().rank == 3:
        raise ValueError("rank three refuses")
    return state.get().rank


@pytest.mark.session
def test_panel_drives_a_live_session(session4):
    s = session4
    s.load_model("tiny-llama")
    p = s.panel()
    assert p.session is s and "(loaded)" in p.plan_section.messages.value
    p.plan_section.degrees["dp"].value = 4
    p.plan_section.apply.click()
    assert p.error_text == "", p.error_text
    assert s.plan.dp == 4
    t0 = time.monotonic()
    p.train(3)
    assert p.wait(120), "training did not finish"
    print(f"3 steps through the panel: {time.monotonic() - t0:.1f} s")
    assert p.error_text == "", p.error_text
    loss = p.views.loss
    assert sorted(t.name for t in loss.data) == ["mean", "rank 0", "rank 1", "rank 2", "rank 3"]
    assert all(len(t.x) == 3 for t in loss.data)
    p.run_section.prompts.value = "hello"
    p.run_section.max_tokens.value = 4
    p.run_section.generate.click()
    assert p.error_text == "" and "<b>hello</b>" in p.run_section.generate_out.value
    assert p.run(_fails_on_rank_three) is None
    assert "rank 3" in p.error_text and "rank three refuses" in p.error_text
    assert p.run(lambda: 7) == [7] * 4 and not p.run_section.generate.disabled
