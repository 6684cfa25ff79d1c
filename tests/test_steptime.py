"""plan/steptime, plan/search and plan/hardware: the step-time model, the plan search and the
profiles, pure (no torch, no processes). Agreement with measured steps on live ranks is
tests/test_steptime_live.py's; the published runs are bench/bench_published.py's table."""
import dataclasses
import math

import pytest

from interactive_parallel import Plan
from interactive_parallel.plan import PRESETS, PlanError, resolve_model
from interactive_parallel.plan.estimate import predict_comms, predict_memory, rank_peak
from interactive_parallel.plan.hardware import H100, PROFILES, get_profile, profile_problems
from interactive_parallel.plan.search import NoPlanFits, search_plans
from interactive_parallel.plan.steptime import (ActionCost, axis_span, comm_seconds, link_of, model_flops, predict_step,
                                                simulate)
from interactive_parallel.plan.validate import validate
from interactive_parallel.records import HardwareProfile, Link, StepPrediction, from_dict

pytestmark = pytest.mark.pure
LLAMA, SMALL = PRESETS["tiny-llama"], PRESETS["small-llama"]
L8, L70 = resolve_model("llama-3-8b"), resolve_model("llama-3-70b")


def gpu(**kw) -> Plan:
    return Plan(device="cuda", precision="bf16", seq_len=8192, **kw)


@pytest.mark.parametrize("plan", [Plan(dp=4), Plan(fsdp=2, tp=2), Plan(pp=2, dp=2), Plan(cp=2, tp=2),
                                  Plan(pp=4, pp_schedule="zbv", microbatches=8)], ids=Plan.describe)
def test_a_prediction_splits_its_seconds_and_derives_its_rates(plan):
    p = predict_step(LLAMA, plan, "cpu")
    assert isinstance(p, StepPrediction) and p.plan == plan.describe() and p.profile == "cpu"
    assert math.isclose(p.compute_s + p.comm_s + p.bubble_s, p.seconds) and min(p.compute_s, p.comm_s, p.bubble_s) >= 0
    assert math.isclose(p.tokens_per_s, plan.batch_size * plan.seq_len / p.seconds)
    peak = plan.world_size * PROFILES["cpu"].peak_flops[plan.precision]
    assert math.isclose(p.mfu, model_flops(LLAMA, plan) / p.seconds / peak) and 0 < p.mfu < 1
    assert p.memory_bytes == max(rank_peak(LLAMA, plan, m) for m in predict_memory(LLAMA, plan))
    assert Plan.from_dict(p.plan_fields) == plan and from_dict(p.to_dict()) == p
    assert (p.bubble_s > 0) == (plan.pp > 1)


def test_model_flops_are_six_per_parameter_and_token_plus_causal_attention():
    plan = gpu(fsdp=8, batch_size=16)
    h, layers, seq = L8.hidden_size, L8.num_layers, plan.seq_len
    dense = sum(math.prod(p.shape) for p in predict_memory.__globals__["param_inventory"](L8)
                if p.owner != "embed" or p.name.startswith("lm_head"))
    assert L8.tied_embeddings is False
    per_token = 6 * (dense - L8.hidden_size * (2 * layers + 1)) + 6 * layers * seq * h  # norms are not matmuls
    assert math.isclose(model_flops(L8, plan), per_token * plan.batch_size * seq, rel_tol=1e-9)


def test_tensor_parallel_splits_the_matmuls_and_adds_its_all_reduces():
    one = predict_step(L70, gpu(fsdp=8, batch_size=8), H100)
    tp8 = predict_step(L70, gpu(tp=8, batch_size=1, loss_parallel=True, sequence_parallel=True), H100)
    # the same tokens per group of 8: tp8 computes an eighth of each matmul on each rank (elementwise
    # work and fixed costs are not split eight ways)
    assert one.compute_s / 8 < tp8.compute_s < one.compute_s / 5
    assert set(tp8.comm_by_axis) == {"tp"} and "fsdp" in one.comm_by_axis


def test_each_collective_costs_latency_per_call_plus_ring_bytes_over_its_link():
    plan = gpu(dp=8, tp=8, batch_size=64)
    for e in predict_comms(L8, plan):
        n, _ = axis_span(plan, e.axis)
        link = H100.link(link_of(plan, e.axis, H100), e.op, n)
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}[e.op]
        calls = e.count if e.count is not None else 1
        assert math.isclose(comm_seconds(plan, e, H100), calls * link.latency_s + e.bytes * factor / link.bandwidth)


def test_a_group_spans_hosts_when_its_ranks_do():
    plan = gpu(dp=16, tp=8, batch_size=16)
    assert link_of(plan, "tp", H100) == "intra" and link_of(plan, "dp", H100) == "inter"
    wide = gpu(tp=16, batch_size=1)
    assert axis_span(wide, "tp") == (16, 15) and link_of(wide, "tp", H100) == "inter"
    assert H100.link("intra", "all_reduce", 8).bandwidth == 480e9 and H100.link("intra", "all_gather").bandwidth == 370e9


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_the_replayed_schedule_gives_the_closed_form_bubble(schedule, v):
    """Uniform stages, free transfers: the bubble is (pp - 1) / (v m) of the ideal step."""
    for pp, m in ((2, 4), (4, 8), (4, 16)):
        plan = Plan(pp=pp, pp_schedule=schedule, virtual_stages=v, microbatches=m, batch_size=m)
        k = plan.stages_per_rank
        span, busy = simulate(plan, [ActionCost(1 / k, 2 / k)] * plan.n_stages, 0.0)
        assert math.isclose(span, 3 * m * (1 + (pp - 1) / (k * m))), (pp, m)
        assert all(math.isclose(b, 3 * m) for b in busy.values())


def test_zero_bubble_schedules_idle_less_than_1f1b_and_transfers_lengthen_the_step():
    base = dict(pp=4, microbatches=8, batch_size=8)
    plain = simulate(Plan(**base), [ActionCost(1, 2)] * 4, 0.0)[0]
    for schedule in ("zbv", "interleaved-zb"):
        plan = Plan(**base, pp_schedule=schedule)
        assert simulate(plan, [ActionCost(0.5, 0.5, 0.5)] * plan.n_stages, 0.0)[0] < plain
    assert simulate(Plan(**base), [ActionCost(1, 2)] * 4, 0.5)[0] > plain


def test_ranks_sharing_cores_run_faster_while_the_others_wait():
    """On the 2-core profile, idle pipeline ranks leave their cores to the busy ones (small-llama:
    its actions outlast the scheduler's handoff)."""
    plan = Plan(pp=4)
    shared = predict_step(SMALL, plan, "cpu")
    alone = predict_step(SMALL, plan, dataclasses.replace(PROFILES["cpu"], cores_per_host=0))
    assert shared.seconds < alone.seconds


def test_a_core_is_handed_over_only_to_work_longer_than_the_handoff():
    """Actions shorter than core_handoff_s run at the every-rank-busy rate: the replay then equals
    one without core sharing; a handoff of 0 is the immediate speed-up."""
    from interactive_parallel.plan.pipeline_time import core_speed

    plan, costs = Plan(pp=4), [ActionCost(0.002, 0.004)] * 4
    speed = core_speed(plan, PROFILES["cpu"])
    alone = simulate(plan, costs, 1e-3)[0]
    assert simulate(plan, costs, 1e-3, speed, handoff_s=0.005)[0] == pytest.approx(alone)
    at_once = simulate(plan, costs, 1e-3, speed, handoff_s=0.0)[0]
    partly = simulate(plan, costs, 1e-3, speed, handoff_s=0.003)[0]
    assert at_once < partly < alone


def test_a_pipeline_action_costs_the_schedule_its_fixed_cost():
    """pipeline_action_s lengthens every pipeline plan (each rank runs 2 m actions a step, more in
    the warm-up's critical path) and no plan without a pipeline."""
    cpu = PROFILES["cpu"]
    heavier = dataclasses.replace(cpu, pipeline_action_s=cpu.pipeline_action_s + 1e-3)
    for kw in (dict(pp=4), dict(pp=2, dp=2), dict(pp=2, tp=2, microbatches=4)):
        plan = Plan(**kw)
        assert predict_step(LLAMA, plan, heavier).seconds - predict_step(LLAMA, plan, cpu).seconds >= \
            2 * plan.n_microbatches * 1e-3 * 0.99
    assert predict_step(LLAMA, Plan(dp=2, tp=2), heavier).seconds == predict_step(LLAMA, Plan(dp=2, tp=2), cpu).seconds


def test_shipped_profiles_hold_every_figure_and_a_bad_one_is_named():
    for p in PROFILES.values():
        assert profile_problems(p) == [] and p.source
    assert PROFILES["h200"].memory_bytes > PROFILES["h100"].memory_bytes
    bad = dataclasses.replace(H100, flops={"bf16": 1e15}, links=[Link("inter", 1e-5, 0.0)], overlap=2.0)
    problems = profile_problems(bad)
    assert any("flops has no rate for fp32, fp16" in x for x in problems)
    assert any("no 'intra' entry" in x for x in problems) and any("overlap" in x for x in problems)
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'"):
        get_profile("tpu")
    with pytest.raises(ValueError, match="lacks memory_bandwidth, devices_per_host"):
        get_profile({"name": "mine", "flops": {}, "peak_flops": {}, "memory_bytes": 1})
    with pytest.raises(ValueError, match="cannot be used"):
        predict_step(LLAMA, Plan(dp=4), bad)
    assert get_profile(H100.to_dict()) == H100 and isinstance(get_profile("h100"), HardwareProfile)


def test_search_ranks_every_valid_layout_that_fits_by_tokens_per_second():
    rows = search_plans("tiny-llama", 4, "cpu", batch_size=8, seq_len=64)
    assert rows and all(isinstance(r, StepPrediction) and r.fits for r in rows)
    rates = [r.tokens_per_s for r in rows]
    assert rates == sorted(rates, reverse=True)
    layouts = {(r.plan_fields["dp"], r.plan_fields["fsdp"], r.plan_fields["tp"], r.plan_fields["pp"],
                r.plan_fields["cp"]) for r in rows}
    assert len(layouts) == len(rows) and (4, 1, 1, 1, 1) in layouts and (1, 1, 4, 1, 1) in layouts
    for r in rows:
        plan = Plan.from_dict(r.plan_fields)
        assert validate(plan, 4, LLAMA) == []
        assert r.memory_bytes == max(rank_peak(LLAMA, plan, m) for m in predict_memory(LLAMA, plan))
    assert "recompute" in str(rows) and "tokens_per_s" in str(rows)


def test_search_holds_fixed_fields_and_trades_recompute_for_memory():
    rows = search_plans(SMALL, 4, "cpu", batch_size=8, seq_len=64, tp=2)
    assert all(r.plan_fields["tp"] == 2 for r in rows)
    free = search_plans(SMALL, 4, "cpu", batch_size=8, seq_len=256, top=1)[0]
    tight = search_plans(SMALL, 4, "cpu", batch_size=8, seq_len=256, top=1, memory_per_rank=free.memory_bytes - 1)[0]
    assert tight.memory_bytes < free.memory_bytes and tight.seconds >= free.seconds


def test_search_refuses_what_nothing_can_run_naming_the_numbers():
    with pytest.raises(NoPlanFits, match=r"no layout of tiny-llama on 4 ranks fits 0.00 GiB per rank: the closest, "
                                         r".* needs .* GiB on its fullest rank") as exc:
        search_plans("tiny-llama", 4, "cpu", memory_per_rank=1000)
    assert exc.value.closest is not None and exc.value.closest.memory_bytes > 1000
    with pytest.raises(PlanError, match=r"no valid layout of tiny-llama on 7 ranks at batch_size\(8\)"):
        search_plans("tiny-llama", 7, "cpu", batch_size=8)
    with pytest.raises(ValueError, match="tpp is not a Plan field"):
        search_plans("tiny-llama", 4, "cpu", tpp=2)
    with pytest.raises(ValueError, match="unknown hardware profile"):
        search_plans("tiny-llama", 4, "laptop")


def test_search_over_a_real_model_finds_a_layout_that_fits_an_h100():
    rows = search_plans(L70, 64, "h100", batch_size=64, seq_len=8192, top=3)
    assert len(rows) == 3 and all(r.memory_bytes <= H100.memory_bytes for r in rows)
    assert all(0.05 < r.mfu < 0.8 for r in rows)
