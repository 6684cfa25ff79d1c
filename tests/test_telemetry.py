"""Seeing inside every rank, on a live 4-rank Session (gloo, CPU, tiny-llama, fp32):
the comm ledger against gradient bytes, CommDebugMode and pipeline activations; memory
against plan/estimate exactly; layout reassembling every parameter; any rank's weight, gradient
and AdamW state fetched, and a whole one put together on the client; figures and the report
from recorded data; the collective debug mode."""
from __future__ import annotations

import collections
import re

import pytest
import torch

from interactive_parallel import Plan
from interactive_parallel.cluster import RankError
from interactive_parallel.plan import PRESETS
from interactive_parallel.plan.estimate import predict_comms
from interactive_parallel.records import CommRecord, PipelineEvent
from test_activations import ACT_TOLERANCE

pytestmark = pytest.mark.session
SPEC = PRESETS["tiny-llama"]
BASE = dict(batch_size=8, seq_len=32, seed=1)


def _run(session, plan: Plan, steps: int = 2):
    if session.spec is None or session.spec.name != SPEC.name:
        session.load_model(SPEC.name)
    session.apply(plan)
    session.train(steps=steps)
    return session


def _by_rank(records, op=None, axis=None):
    out = collections.defaultdict(int)
    for r in records:
        if (op is None or r.op == op) and (axis is None or r.axis == axis):
            out[r.rank] += r.bytes
    return dict(out)


# ---------------------------------------------------------------- rank-side helpers

def ledger_and_commdebugmode() -> tuple[dict, dict]:
    """One training step under CommDebugMode: (our ledger's count per op, CommDebugMode's)."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker

    from interactive_parallel.runtime.rank import state
    from interactive_parallel.runtime.training.train import train_step

    class OneHookPerCall(_CommModeModuleTracker):
        """CommDebugMode's module tracker keeps one forward hook per module name and drops the
        handle of the previous call's, so a module instance called twice in a step (transformers
        >= 5.25 makes apply_rotary_pos_emb one shared nn.Module that every layer calls) pops its
        parent list twice and leaves a hook behind on that module for good. The previous call's
        hook has fired by the next call: remove it then."""

        def _fw_pre_hook(self, mod, input):
            old = self.register_forward_hook_handles.pop(self._get_mod_name(mod), None)
            if old is not None:
                old.remove()
            super()._fw_pre_hook(mod, input)

    st = state.get()
    cdm = CommDebugMode()
    cdm.advanced_module_tracker = OneHookPerCall()
    with cdm:
        rec = train_step(st.parallel, st.optimizer, st.step, rank=st.rank)
    ours = collections.Counter(c.op for c in rec.comms)
    theirs: collections.Counter = collections.Counter()
    for op, n in cdm.get_comm_counts().items():
        name = str(op).split(".")[-1]
        theirs[{"allreduce_": "all_reduce", "_allgather_base_": "all_gather", "broadcast_": "broadcast",
                "_reduce_scatter_base_": "reduce_scatter", "all_gather_into_tensor": "all_gather",
                "reduce_scatter_tensor": "reduce_scatter"}.get(name, name)] += n
    return dict(ours), dict(theirs)


def local_params() -> dict[str, torch.Tensor]:
    from interactive_parallel.runtime.rank import state

    par = state.get().parallel
    owned = set(par.owned_keys())
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for n, p in par.raw.named_parameters() if n in owned}


def full_params() -> dict[str, torch.Tensor]:
    from interactive_parallel.runtime.rank import state

    return state.get().parallel.full_state_dict()


def mismatched_all_reduce() -> float:
    import torch.distributed as dist

    t = torch.ones(3 if dist.get_rank() == 1 else 4)
    dist.all_reduce(t)
    return float(t.sum())


def good_all_reduce() -> float:
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    return float(t.sum())


# ---------------------------------------------------------------- the ledger

def test_ddp_all_reduce_bytes_equal_gradient_bytes(session4):
    _run(session4, Plan(dp=4, **BASE))
    comms, mem = session4.comms(), session4.memory()
    reduced = _by_rank(comms, "all_reduce", "dp")
    vote = 4  # a Session's stop vote rides in the last bucket: one float32 (runtime.rank.channel.ddp_vote_hook)
    assert reduced == {m.rank: m.grads + vote for m in mem}, "bucket bytes summed over a step = gradient bytes"
    assert all(c.end >= c.start > 0 and c.group == [0, 1, 2, 3] for c in comms)
    # besides the buckets only DDP's one-off broadcast of rebuilt bucket indices (int32, step 1)
    assert {(c.op, c.dtype) for c in comms} <= {("all_reduce", "float32"), ("broadcast", "int32")}, comms
    pred = predict_comms(SPEC, session4.plan)
    assert [(p.op, p.axis, p.count, p.bytes) for p in pred] == [("all_reduce", "dp", None, reduced[0] - vote)]


def test_tp_ledger_counts_equal_commdebugmode(session4):
    _run(session4, Plan(dp=2, tp=2, **BASE), steps=1)
    for ours, theirs in session4.run(ledger_and_commdebugmode):
        assert ours == theirs
        assert ours.get("all_reduce", 0) > 0
    counts = collections.Counter((c.op, c.axis) for c in session4.comms() if c.rank == 0)
    pred = {(p.op, p.axis): p.count for p in predict_comms(SPEC, session4.plan)}
    assert counts == pred
    # under a pipeline each microbatch all-reduces in its stage's layers: m times the calls
    _run(session4, Plan(pp=2, tp=2, microbatches=2, **BASE), steps=1)
    counts = collections.Counter((c.op, c.axis) for c in session4.comms() if c.rank == 0)
    pred = {(p.op, p.axis): p.count for p in predict_comms(SPEC, session4.plan)}
    assert counts[("all_reduce", "tp")] == pred[("all_reduce", "tp")] > 0


def test_pp_p2p_bytes_equal_activations_times_microbatches(session4):
    plan = Plan(dp=2, pp=2, microbatches=2, **BASE)
    _run(session4, plan)
    rows = plan.batch_size // plan.data_parallel // plan.microbatches
    act = rows * plan.seq_len * SPEC.hidden_size * 4  # fp32 hidden states of one microbatch
    comms = session4.comms()
    for op in ("send", "recv"):
        assert _by_rank(comms, op, "pp") == {r: act * plan.microbatches for r in range(4)}
    # mesh (pp, dp): ranks 0,1 hold stage 0 and send activations to 2,3; gradients come back
    assert {(c.rank, c.peer) for c in comms if c.op == "send"} == {(0, 2), (1, 3), (2, 0), (3, 1)}
    events = [e for e in session4.timeline() if isinstance(e, PipelineEvent)]
    seen = collections.Counter((e.rank, e.stage, e.action) for e in events)
    assert seen == {(r, r // 2, a): plan.microbatches for r in range(4) for a in "FB"}
    assert all(e.end >= e.start > 0 for e in events)


# ---------------------------------------------------------------- memory

MEMORY_PLANS = [
    pytest.param(dict(dp=4), id="dp4"),
    pytest.param(dict(fsdp=4), id="fsdp4"),
    pytest.param(dict(dp=2, tp=2), id="dp2tp2"),
    pytest.param(dict(dp=2, pp=2), id="dp2pp2"),
]


@pytest.mark.parametrize("degrees", MEMORY_PLANS)
def test_memory_equals_prediction(session4, degrees):
    _run(session4, Plan(**degrees, **BASE))
    mem, predicted = session4.memory(), session4.predict_memory()
    pred = {p.rank: p for p in predicted}
    assert sorted(m.rank for m in mem) == [0, 1, 2, 3]
    for m in mem:
        p = pred[m.rank]
        assert (m.params, m.grads, m.optimizer) == (p.params, p.grads, p.optimizer), m
        assert abs(p.activations - m.activations) <= ACT_TOLERANCE * m.activations, (m, p)
        assert m.rss > 0
    assert session4.predict_memory(session4.plan) == predicted


# ---------------------------------------------------------------- layout

@pytest.mark.parametrize("degrees", [dict(dp=2, tp=2), dict(fsdp=2, tp=2)], ids=["dp2tp2", "fsdp2tp2"])
def test_layout_reassembles_every_parameter(session4, degrees):
    session4.load_model(SPEC.name)
    session4.apply(Plan(**degrees, **BASE))
    shards = session4.layout()
    locals_ = session4.run(local_params)
    full = session4.run(full_params)[0]
    names = {s.param for s in shards}
    assert names == set(locals_[0]) and len(shards) == 4 * len(names)
    assert any("Shard" in p for s in shards for p in s.placements)
    for name in names:
        rebuilt = torch.full_like(full[name], float("nan"))
        for s in (s for s in shards if s.param == name):
            piece = locals_[s.rank][name]
            assert list(piece.shape) == s.local_shape
            rebuilt[tuple(slice(a, b) for a, b in s.index)] = piece
        torch.testing.assert_close(rebuilt, full[name], rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- fetch: any rank's tensor

def grads_now() -> dict[str, torch.Tensor]:
    """Full gradients of the current step's batch on the current weights, gathered by the ranks."""
    from interactive_parallel.runtime.rank import state
    from interactive_parallel.runtime.training.verify import loss_and_grads

    st = state.get()
    return loss_and_grads(st.parallel, st.step)[1]


def adam_state(name: str) -> tuple[list[str], torch.Tensor]:
    """(the state names AdamW keeps for any parameter, this rank's block of `name`'s exp_avg)."""
    from interactive_parallel.runtime.rank import state

    st = state.get()
    p = dict(st.parallel.raw.named_parameters())[name]
    exp_avg = st.optimizer.state[p]["exp_avg"]
    return sorted({k for s in st.optimizer.state.values() for k in s}), exp_avg._local_tensor.clone()


def test_fetch_reads_any_ranks_block_and_puts_the_whole_together(session4, monkeypatch):
    from interactive_parallel.cluster.fetch import FetchError
    from interactive_parallel.records import TENSOR_KINDS

    s = _run(session4, Plan(fsdp=2, tp=2, **BASE), steps=1)
    name = "model.layers.0.self_attn.q_proj.weight"
    layout = {r.rank: r for r in s.layout() if r.param == name}
    a, b = s.fetch(name, rank=0), s.fetch(name, rank=1)
    assert a.index != b.index and any("Shard" in p for p in a.placements)
    for got in (a, b):
        assert list(got.shape) == layout[got.rank].local_shape and got.index == layout[got.rank].index
    whole, reference = s.fetch(name, full=True), s.run(full_params)[0][name]  # gathered by the ranks
    torch.testing.assert_close(whole.tensor, reference, rtol=0, atol=0)
    torch.testing.assert_close(b.tensor, reference[tuple(slice(x, y) for x, y in b.index)], rtol=0, atol=0)
    # a gradient on request: the one the ranks' own forward and backward of the same batch gives
    grad, grads = s.fetch(name, rank=1, what="grad"), s.fetch(name, full=True, what="grad")
    assert grad.shape == b.shape and grad.tensor.abs().sum() > 0
    torch.testing.assert_close(grads.tensor, s.run(grads_now)[0][name], rtol=0, atol=0)
    names, exp_avg = s.run(adam_state, name)[1]
    assert names == sorted(TENSOR_KINDS[2:])  # what AdamW really holds is what fetch offers
    torch.testing.assert_close(s.fetch(name, rank=1, what="exp_avg").tensor, exp_avg, rtol=0, atol=0)
    assert float(s.fetch(name, rank=3, what="step").tensor) == 1.0
    # bad input: refused on the layout the client holds, before any rank is touched
    monkeypatch.setattr(s.ranks.caller, "submit", lambda *a, **k: pytest.fail("rank touched"))
    with pytest.raises(FetchError, match=r"nearest: model\.layers\.0\.self_attn\.q_proj\.weight"):
        s.fetch("model.layers.0.self_attn.q_proj.weigth")
    with pytest.raises(FetchError, match=r"outside this session of 4 ranks"):
        s.fetch(name, rank=4)
    with pytest.raises(FetchError, match="exp_avg_sq"):
        s.fetch(name, what="momentum")
    with pytest.raises(FetchError, match=r"is 16\.0 KiB \(16,384 bytes\), shape \(64, 64\) fp32, "
                                         r"over the limit of 1000 B"):
        s.fetch(name, full=True, limit_bytes=1000)


# ---------------------------------------------------------------- figures and report

def test_figures_and_report_from_recorded_data(session4, tmp_path):
    from interactive_parallel.viz import (comm_matrix_figure, figures_from_records, memory_figure, pipeline_figure,
                                          sharding_figure, timeline_figure)

    _run(session4, Plan(dp=2, pp=2, **BASE))
    mem, comms, tl, shards = session4.memory(), session4.comms(), session4.timeline(), session4.layout()
    names = [t.name for t in memory_figure(mem, session4.predict_memory()).data]
    assert {"params", "grads", "optimizer", "activations", "params (predicted)"} <= set(names)
    assert {t.name for t in timeline_figure([r for r in tl if isinstance(r, CommRecord)],
                                            [r for r in tl if isinstance(r, PipelineEvent)]).data} >= \
        {"send", "recv", "all_reduce", "F: forward", "B: backward"}
    assert {t.name for t in pipeline_figure(tl).data} == {"F: forward", "B: backward"}
    assert sum(map(sum, comm_matrix_figure(comms).data[0].z)) > 0
    assert len(sharding_figure(shards, "lm_head.weight").data) >= 1
    figs = figures_from_records(session4.records())
    assert {"loss", "throughput", "memory", "comm_matrix", "comm_breakdown", "timeline", "pipeline"} <= set(figs)
    assert any(k.startswith("sharding-") for k in figs)
    html = open(session4.report(str(tmp_path / "r.html")), encoding="utf-8").read()
    assert all(f'<section id="{k}">' in html for k in figs)


# ---------------------------------------------------------------- debug mode

def test_debug_mode_names_a_mismatched_collective_and_session_survives(session4):
    from interactive_parallel.cluster import SessionError

    session4.load_model(SPEC.name)
    session4.apply(Plan(dp=4, **BASE))
    with pytest.raises(SessionError, match="DDP"):  # refused before any rank is touched
        session4.set_debug(True)
    session4.apply(Plan(fsdp=4, **BASE))
    session4.train(steps=1)
    session4.set_debug(True)
    try:
        with pytest.raises(RankError) as exc:
            session4.run(mismatched_all_reduce, timeout=60)
        text = str(exc.value)
        assert re.search(r"mismatch", text, re.I) and "rank" in text.lower(), text[:2000]
        assert re.search(r"\[3\]|\[4\]|sizes", text), text[:2000]
        assert session4.run(good_all_reduce) == [16.0] * 4
        assert len(session4.train(steps=1)) == 4
    finally:
        session4.set_debug(False)
    assert session4.run(good_all_reduce) == [16.0] * 4


# ---------------------------------------------------------------- experts (no ranks needed)

def test_experts_are_kept_for_every_step_when_comms_are_stripped():
    from interactive_parallel.cluster.telemetry import EXPERT_COLUMNS, TELEMETRY_STEPS, Telemetry
    from interactive_parallel.records import ExpertRecord, StepRecord

    def step(s: int) -> list[StepRecord]:
        return [StepRecord(rank=r, step=s, loss=1.0, tokens=8, time_s=0.1,
                           comms=[CommRecord(rank=r, step=s, op="all_to_all", bytes=64, dtype="float32")],
                           experts=[ExpertRecord(rank=r, step=s, layer=layer, experts=[2 * r, 2 * r + 1],
                                                 tokens=[4, 4], routed=[2, 2, 2, 2], sent=[4, 4], received=[4, 4],
                                                 ep_group=[0, 1]) for layer in (0, 1)])
                for r in (0, 1)]

    t = Telemetry()
    for s in range(TELEMETRY_STEPS + 3):
        t.add_step(step(s))
    assert all(not r.comms and len(r.experts) == 2 for r in t.history)  # comms stripped, experts kept
    every = t.experts()
    assert every.columns == EXPERT_COLUMNS and all(isinstance(e, ExpertRecord) for e in every)
    assert len(every) == 4 * (TELEMETRY_STEPS + 3) and every[0].step == 0  # older than the probes' window
    latest = t.experts(2)
    assert [(e.step, e.rank, e.layer) for e in latest] == [
        (s, r, layer) for s in (TELEMETRY_STEPS + 1, TELEMETRY_STEPS + 2) for r in (0, 1) for layer in (0, 1)]
    assert "ep_group" in str(latest)
    assert Telemetry().experts() == []
