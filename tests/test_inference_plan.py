"""Inference decisions made before any rank runs (plan/inference.py) and the inference figures
(viz/decoding.py, viz/serving.py): which serving engine runs under which plan and why, which
quantization a plan can hold, every problem with a list of requests, and figures from records."""
from __future__ import annotations

import pytest

from interactive_parallel import viz
from interactive_parallel.plan import PRESETS, Plan
from interactive_parallel.plan.inference import (QUANT_SCHEMES, quantization_problems, request_problems,
                                                 serving_engine)
from interactive_parallel.records import DecodeStep, QuantizeRecord, Request, RequestRecord, ServeResult

pytestmark = pytest.mark.pure
LLAMA, GPT2 = PRESETS["tiny-llama"], PRESETS["tiny-gpt2"]
GREEDY = [Request(id="a", prompt="1+1=")]


@pytest.mark.parametrize("fields, spec, engine", [
    (dict(), LLAMA, "transformers"), (dict(dp=4), LLAMA, "transformers"), (dict(dp=2, tp=2), LLAMA, "transformers"),
    (dict(tp=2), GPT2, "ours"), (dict(dp=2), GPT2, "transformers"), (dict(pp=2), LLAMA, "ours"),
    (dict(cp=2), LLAMA, "ours"), (dict(fsdp=2), LLAMA, "ours"), (dict(tp=2, sequence_parallel=True), LLAMA, "ours"),
])
def test_auto_picks_transformers_engine_where_it_runs(fields, spec, engine):
    chosen, why = serving_engine(Plan(**fields), spec, GREEDY)
    assert chosen == engine, why
    assert why


def test_engine_choice_names_its_reason_and_refuses_what_cannot_run():
    assert serving_engine(Plan(pp=2), LLAMA, GREEDY)[1].startswith("transformers' engine cannot: pp(2)")
    assert serving_engine(Plan(), LLAMA, GREEDY, policy="static")[0] == "ours"
    sampled = [Request(id="a", prompt="1=", do_sample=True)]
    assert "own" in serving_engine(Plan(), LLAMA, sampled)[1]
    assert serving_engine(Plan(), LLAMA, GREEDY, engine="ours") == ("ours", "asked for")
    with pytest.raises(ValueError, match=r"cannot serve here: fsdp\(2\)"):
        serving_engine(Plan(fsdp=2), LLAMA, GREEDY, engine="transformers")
    with pytest.raises(ValueError, match="policy 'fifo' is not one of"):
        serving_engine(Plan(), LLAMA, GREEDY, policy="fifo")


def test_quantization_problems_name_the_plan_and_the_reason():
    assert quantization_problems(Plan(dp=4), "int8-weight-only", LLAMA) == []
    assert quantization_problems(Plan(tp=2, pp=2), "int4-weight-only", LLAMA) == []
    assert "unknown quantization scheme 'fp4'" in quantization_problems(Plan(), "fp4", LLAMA)[0]
    assert "plan fsdp2: FSDP gathers" in quantization_problems(Plan(fsdp=2), "int8-weight-only", LLAMA)[0]
    assert "plan tp2: int8-dynamic" in quantization_problems(Plan(tp=2), "int8-dynamic", LLAMA)[0]
    assert "Conv1D" in quantization_problems(Plan(), "int8-weight-only", GPT2)[0]
    # int4's groups of 32 input features: o_proj's 64 split in 4 is 16 a rank (notebook 08's question 3)
    assert quantization_problems(Plan(tp=4), "int4-weight-only", LLAMA) == [
        "plan tp4: int4-weight-only quantizes groups of 32 input features, and under tp(4) a rowwise linear's "
        "slice holds no whole number of groups: self_attn.o_proj (64 input features: 16 a rank); a smaller tp, "
        "or int8-weight-only, can"]
    assert set(QUANT_SCHEMES) == {"int8-weight-only", "int8-dynamic", "int4-weight-only"}


def test_request_problems_are_all_listed_with_their_numbers():
    reqs = [Request(id="a", prompt=""), Request(id="a", prompt="1=", arrival=-2.0),
            Request(id="b", prompt="x" * 250, max_new_tokens=10), Request(id="c", prompt="1=", max_new_tokens=0),
            Request(id="d", prompt="1=", temperature=0.0, top_k=-1, stop=[""])]
    problems = "\n".join(request_problems(reqs, LLAMA, max_batch=0))
    for needle in ("max_batch(0) must be >= 1", "request 'a': prompt must be a non-empty string",
                   "duplicate request id 'a' (requests 0 and 1)", "arrival(-2.0) must be >= 0 seconds",
                   "prompt(250) + max_new_tokens(10) > tiny-llama max positions(256)",
                   "max_new_tokens(0) must be >= 1", "temperature(0.0) must be > 0", "top_k(-1) must be >= 0",
                   "stop strings must be non-empty"):
        assert needle in problems
    too_big = request_problems([Request(id="a", prompt="12345", max_new_tokens=10)], LLAMA, kv_tokens=8)
    assert too_big == ["request 'a': prompt(5) + max_new_tokens(10) = 15 > kv_tokens(8): it could never be admitted"]
    assert request_problems(GREEDY, LLAMA) == []


def _requests():
    return [RequestRecord(id="r0", rank=0, prompt="1=", arrival=0.0, admitted=0.1, first_token=0.15, finished=0.5,
                          tokens=5, text="2\n", finish_reason="stop"),
            RequestRecord(id="r1", rank=0, prompt="2=", arrival=0.2, finish_reason="interrupted")]


def _steps():
    return [DecodeStep(rank=r, step=k, phase="decode", start=0.0, time_s=0.02, tokens=2, running=2, waiting=k % 2,
                       kv_bytes=4096 * (k + 1), kv_budget=65536, comm_s=0.005 * r) for r in range(2) for k in range(3)]


def test_request_timeline_has_a_row_per_request_and_its_phases():
    phases = viz.request_phases(_requests())
    assert phases[0]["waiting"] == (0.0, 0.1) and phases[0]["prefill"] == (0.1, 0.15)
    assert phases[0]["decode"] == (0.15, 0.5) and phases[1]["prefill"] is None and phases[1]["end"] is None
    fig = viz.request_timeline_figure(_requests())
    bars = {t.name: t for t in fig.data}
    assert list(bars["decode"].y) == ["r0"] and bars["decode"].x[0] == pytest.approx(0.35)
    assert list(bars["waiting"].y) == ["r0", "r1"] and list(bars["done"].text) == ["stop"]
    assert viz.request_timeline_figure([]).layout.annotations[0].text.startswith("no requests")


def test_latency_tokens_kv_and_split_figures_come_from_records():
    lat = viz.latency_figure(_requests())
    assert lat.data[0].y[0] == pytest.approx(150.0) and lat.data[1].y[0] == pytest.approx(87.5)
    tokens = viz.tokens_per_step_figure(_steps())
    assert {t.name for t in tokens.data} >= {"rank 0 tokens", "rank 1 tokens", "rank 0 waiting"}
    kv = viz.kv_memory_figure(_steps())
    assert kv.data[0].y[-1] == pytest.approx(3 * 4096 / 2 ** 20) and any("budget" in t.name for t in kv.data)
    split = viz.step_split_figure(_steps())
    comm = [t for t in split.data if t.name == "communication"]
    assert len(comm) == 2 and comm[1].y[0] == pytest.approx(5.0) and comm[0].y[0] == 0.0
    q = [QuantizeRecord(rank=0, scheme="int8-weight-only", plan="dp1", linears=28, params_before=2 ** 20,
                        params_after=2 ** 18, kept_bytes=2 ** 20, tokens_per_s_before=100.0,
                        tokens_per_s_after=120.0, agreement=0.75)]
    fig = viz.quantization_figure(q)
    assert "unchanged 75%" in fig.layout.title.text and fig.data[1].y[0] == pytest.approx(0.25)
    result = ServeResult(engine="ours", reason="", policy="continuous", plan="dp2", wall_s=1.0,
                         requests=_requests(), steps=_steps())
    assert {"requests", "latency", "tokens_per_step", "kv_memory", "step_split", "quantization"} <= set(
        viz.figures_from_records([result, *result.steps, *q]))
    assert result.tokens_per_s == 5.0 and result.n_steps == 3 and result.mean_ttft == pytest.approx(0.15)
    assert "r0" in str(result)


def test_staggered_requests_arrive_in_turn_with_mixed_lengths():
    from interactive_parallel.plan.inference import staggered_requests

    reqs = staggered_requests(6, 0.1, 16, ["a=", "b="], do_sample=True, temperature=0.5)
    assert [r.id for r in reqs] == [f"r{i}" for i in range(6)] and [r.prompt for r in reqs[:3]] == ["a=", "b=", "a="]
    assert [r.arrival for r in reqs] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    assert [r.max_new_tokens for r in reqs[:4]] == [4, 16, 8, 12] and {r.seed for r in reqs} == set(range(6))
    assert all(r.do_sample and r.temperature == 0.5 for r in reqs) and request_problems(reqs, LLAMA) == []


def test_tokens_per_step_compares_runs_by_label():
    runs = {"continuous": _steps()[:3], "static": _steps()[3:]}
    fig = viz.tokens_per_step_figure(runs)
    assert [t.name for t in fig.data if t.type == "bar"] == ["continuous tokens", "static tokens"]
