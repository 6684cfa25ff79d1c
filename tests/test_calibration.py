"""Calibration: the fit recovers the figures samples were made from (the slowest rank's), refuses
incomplete samples by name; the options follow the model's shapes; on a live session the
ranks measure a profile the step-time model accepts, and the ranks work on afterwards."""
from __future__ import annotations

import dataclasses

import pytest

from interactive_parallel.plan import PRESETS, Plan
from interactive_parallel.plan.calibration import (CalibrationError, bus_factor, calibrate_options, fit_line,
                                                   fit_profile, linear_shapes, micro_tokens)
from interactive_parallel.plan.hardware import get_profile, profile_problems
from interactive_parallel.records import HostMemory
from interactive_parallel.records.calibration import (OVERLAP_BOTH, OVERLAP_COLLECTIVE, OVERLAP_MATMUL,
                                                      CalibrateOptions)
from interactive_parallel.records.hardware import CalibrationSample

RANKS = 4
MM = {"fp32": (50e-6, 2e10), "bf16": (80e-6, 5e9)}  # precision -> (matmul + op fixed cost, FLOP/s)
OP = (20e-6, 5e9)  # (op_overhead_s, memory bandwidth)
LINKS = {("all_reduce", 2): (2e-3, 4e8), ("all_reduce", 4): (6e-3, 3e8), ("all_gather", 4): (4e-3, 2e8),
         ("send", 2): (1e-3, 1e9)}
OVERLAP = (10e-3, 8e-3, 14e-3)  # burst, all_reduce, both: 4 ms of 8 hidden -> 0.5


def _samples(slow_rank: int = 3, fast: float = 0.8) -> list[CalibrationSample]:
    """Every rank's samples made from the figures above; the ranks but `slow_rank` take `fast` of the time."""
    out = []
    for rank in range(RANKS):
        k = 1.0 if rank == slow_rank else fast

        def add(**kw):
            out.append(CalibrationSample(rank=rank, seconds=kw.pop("t") * k, **kw))

        for precision, (a, rate) in MM.items():
            for flops in (1e5, 1e6, 1e7, 1e8):
                add(what="matmul", name=f"mm {flops} {precision}", t=a + flops / rate, flops=int(flops),
                    precision=precision)
        for nbytes in (3e3, 3e4, 3e5, 3e6):
            add(what="op", name=f"add {nbytes}", t=OP[0] + nbytes / OP[1], bytes=int(nbytes))
        for (op, n), (lat, bw) in LINKS.items():
            for nbytes in (1 << 10, 1 << 14, 1 << 18, 1 << 21):
                add(what="collective", name=f"{op} g{n} {nbytes}", t=lat + nbytes * bus_factor(op, n) / bw,
                    bytes=nbytes, op=op, size=n)
        for op, t in zip((OVERLAP_MATMUL, OVERLAP_COLLECTIVE, OVERLAP_BOTH), OVERLAP):
            add(what="collective", name=op, t=t, op=op, size=RANKS, bytes=1 << 21)
    return out


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 0.01 * abs(want)


@pytest.mark.pure
def test_fit_recovers_the_figures_of_the_slowest_rank():
    memory = [HostMemory(rank=r, host="h", available=8 << 30) for r in range(RANKS)]
    p = fit_profile(_samples(slow_rank=2), get_profile("cpu"), host_memory=memory, device="cpu", cores_per_host=2)
    assert _close(p.op_overhead_s, OP[0]) and _close(p.memory_bandwidth, OP[1])
    for precision, (a, rate) in MM.items():
        assert _close(p.flops[precision], rate)
    assert _close(p.matmul_overhead_s, MM["fp32"][0] - OP[0])
    for (op, n), (lat, bw) in LINKS.items():
        link = p.link("intra", op, n)
        assert (link.op, link.size) == (op, n) and _close(link.latency_s, lat) and _close(link.bandwidth, bw)
    recv = p.link("intra", "recv", 2)
    assert recv.op == "recv" and _close(recv.bandwidth, LINKS[("send", 2)][1])
    assert _close(p.overlap, 0.5)
    # What calibration does not measure comes from the base; the rest from the hosts.
    assert p.flops["fp16"] == get_profile("cpu").flops["fp16"] and p.peak_flops == get_profile("cpu").peak_flops
    assert (p.memory_bytes, p.devices_per_host, p.cores_per_host, p.device) == ((8 << 30) // RANKS, RANKS, 2, "cpu")
    assert "4 ranks" in p.source and profile_problems(p) == []
    assert {x.op for x in p.links if x.link == "intra"} >= {"*", "all_reduce", "all_gather", "send", "recv"}


RECV = (0.3e-3, 2e9)  # a message to a receiver already waiting: (latency, bandwidth)
HANDOFF, ACTION = 3e-3, 1e-3  # core_handoff_s, pipeline_action_s


def _pipeline_samples(profile) -> list[CalibrationSample]:
    """What the ranks would measure if a send to a waiting receiver cost RECV, an idle rank's core
    reached a busy one after HANDOFF and each pipeline action cost ACTION (the replay's own figures)."""
    from interactive_parallel.plan.pipeline_time import ActionCost, core_speed, simulate

    out = []
    for rank in range(RANKS):
        for nbytes in (1 << 10, 1 << 14, 1 << 18, 1 << 21):
            out.append(CalibrationSample(rank=rank, what="collective", name=f"recv g2 {nbytes}", op="recv", size=2,
                                         bytes=nbytes, seconds=RECV[0] + nbytes / RECV[1]))
        for k, busy in enumerate((0.002, 0.005, 0.01, 0.02, 0.04)):
            alone = min(busy, HANDOFF) + max(busy - HANDOFF, 0) / 2  # half the ranks idle: twice as fast
            out += [CalibrationSample(rank=rank, what="handoff", name=f"burst {k} on {n}", size=n, microbatches=k,
                                      seconds=t) for n, t in ((RANKS, busy), (RANKS // 2, alone))]
        for n in (2, 4):
            for m in (n, 2 * n):
                plan = Plan(pp=n, dp=RANKS // n, microbatches=m, pp_schedule="1f1b", batch_size=m * RANKS // n)
                t = simulate(plan, [ActionCost(ACTION, ACTION)] * n, RECV[0], core_speed(plan, profile), HANDOFF)[0]
                out.append(CalibrationSample(rank=rank, what="pipeline", name=f"pp{n} m{m}", size=n, microbatches=m,
                                             seconds=t))
    return out


@pytest.mark.pure
def test_fit_recovers_the_waiting_receiver_the_core_handoff_and_a_pipeline_action():
    memory = [HostMemory(rank=r, host="h", available=8 << 30) for r in range(RANKS)]
    kw = dict(host_memory=memory, device="cpu", cores_per_host=2)
    plain = fit_profile(_samples(), get_profile("cpu"), **kw)
    p = fit_profile(_samples() + _pipeline_samples(plain), get_profile("cpu"), **kw)
    recv = p.link("intra", "recv", 2)
    assert recv.op == "recv" and _close(recv.latency_s, RECV[0]) and _close(recv.bandwidth, RECV[1])
    send = p.link("intra", "send", 2)  # the send after a burst on both sides keeps its own figures
    assert _close(send.latency_s, LINKS[("send", 2)][0])
    assert abs(p.core_handoff_s - HANDOFF) <= 1e-4 and _close(p.pipeline_action_s, ACTION)
    assert "pipeline steps" in p.source and "core handoff" in p.source
    # without those samples the base's figures stand
    assert (plain.core_handoff_s, plain.pipeline_action_s) == (get_profile("cpu").core_handoff_s,
                                                                get_profile("cpu").pipeline_action_s)


@pytest.mark.pure
def test_the_slowest_rank_is_taken_per_sample():
    samples = _samples(slow_rank=0, fast=0.5)
    slow = fit_profile(samples)
    fast = fit_profile([s for s in samples if s.rank != 0])  # ranks 1-3 at half the time
    assert _close(slow.flops["fp32"], MM["fp32"][1]) and _close(fast.flops["fp32"], 2 * MM["fp32"][1])
    assert _close(slow.link("intra", "all_reduce", 4).latency_s, 2 * fast.link("intra", "all_reduce", 4).latency_s)


@pytest.mark.pure
def test_missing_samples_are_refused_by_name():
    with pytest.raises(CalibrationError, match="no calibration samples"):
        fit_profile([])
    samples = _samples()
    for what, word in (("op", "op"), ("matmul", "matmul"), ("collective", "collective")):
        with pytest.raises(CalibrationError, match=f"no {word}"):
            fit_profile([s for s in samples if s.what != what])
    lacking = [s for s in samples if not (s.rank == 2 and s.name == "add 3000.0")]
    with pytest.raises(CalibrationError, match=r"'add 3000.0' lacks rank\(s\) \[2\]"):
        fit_profile(lacking)
    with pytest.raises(CalibrationError, match="overlap"):
        fit_profile([s for s in samples if s.op != OVERLAP_BOTH])


@pytest.mark.pure
def test_fit_line_keeps_costs_positive():
    assert fit_line([(1.0, 2.0), (2.0, 3.0)]) == pytest.approx((1.0, 1.0))
    a, rate = fit_line([(1.0, 0.5), (10.0, 11.0)])  # a negative intercept: through the origin
    assert a == 0.0 and rate > 0
    a, rate = fit_line([(1.0, 3.0), (10.0, 2.0)])  # falling with x: noise, kept positive
    assert a == 2.0 and rate == 5.0


@pytest.mark.pure
def test_options_follow_the_model_and_refuse_before_any_rank():
    spec = PRESETS["tiny-llama"]
    shapes = linear_shapes(spec, 4)
    h, inter, vocab = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    for want in [(h, inter), (h, inter // 4), (inter // 2, h), (h, vocab), (h, vocab // 4)]:
        assert want in shapes
    assert linear_shapes(spec, 1) == ((h, h), (h, inter), (inter, h), (h, vocab))  # q, kv, o coincide here
    assert len(set(shapes)) == len(shapes)
    assert micro_tokens(Plan(dp=4), 4) == (128, 512)  # batch 8 x 64 tokens: per rank under dp4, whole under tp4
    options = calibrate_options(spec, 4, precisions=["fp32"])
    assert options.burst == (512, h, inter) and options.precisions == ("fp32",)
    assert CalibrateOptions.from_dict(options.to_dict()) == options
    with pytest.raises(CalibrationError, match="fp16.*CUDA only"):
        calibrate_options(spec, 4, precisions=["fp32", "fp16"])
    with pytest.raises(CalibrationError, match=r"repeats\(0\)"):
        calibrate_options(spec, 4, repeats=0)
    with pytest.raises(CalibrationError, match="at least 2 ranks"):
        calibrate_options(spec, 1)


@pytest.mark.rank1
def test_the_chain_has_the_operations_it_is_divided_by():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from interactive_parallel.runtime.calibration.calibrate import chain_ops, elementwise_chain, layouts

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    chain = elementwise_chain(64, torch.device("cpu"))
    with Count():
        chain()
    assert Count.ops == chain_ops()
    assert layouts(4, 2) == [("consecutive", [[0, 1], [2, 3]]), ("strided", [[0, 2], [1, 3]])]
    assert layouts(4, 4) == [("consecutive", [[0, 1, 2, 3]])]


@pytest.mark.pure
@pytest.mark.parametrize("anchor, field, carried, spared", [
    # a replicated wrapper's excess: DDP and replicate plans carry it, tp / pp / fsdp plans do not
    (dict(dp=4), "replica_overhead_s", [dict(dp=2, tp=2), dict(pp=2, dp=2), dict(cp=2, tp=2)],
     [dict(tp=4), dict(pp=4), dict(fsdp=4), dict(dp=2, fsdp=2)]),
    # any other anchor's excess is the loop's, carried by every plan
    (dict(fsdp=4), "step_overhead_s", [dict(dp=4), dict(tp=4), dict(pp=4), dict(dp=2, fsdp=2)], []),
])
def test_the_anchor_makes_the_measured_plan_exact_and_never_goes_negative(anchor, field, carried, spared):
    from interactive_parallel.plan.calibration import anchor_step_overhead
    from interactive_parallel.plan.steptime import predict_step

    spec, cpu = PRESETS["tiny-llama"], get_profile("cpu")
    plan = Plan(**anchor, batch_size=8, seq_len=64)
    bare_profile = dataclasses.replace(cpu, **{field: 0.0})
    bare = predict_step(spec, plan, bare_profile, memory=False).seconds
    anchored = anchor_step_overhead(cpu, spec, plan, bare + 0.010, steps=5)
    assert getattr(anchored, field) == pytest.approx(0.010)
    other = "step_overhead_s" if field == "replica_overhead_s" else "replica_overhead_s"
    assert getattr(anchored, other) == getattr(cpu, other)
    assert predict_step(spec, plan, anchored, memory=False).seconds == pytest.approx(bare + 0.010)
    assert f"{field} from 5 measured steps of" in anchored.source and anchored.flops == cpu.flops
    # one fixed cost per step: a plan that carries it grows by it, not by a share; the others not at all
    for kw, gain in [(kw, 0.010) for kw in carried] + [(kw, 0.0) for kw in spared]:
        other_plan = Plan(**kw, batch_size=8, seq_len=64)
        grown = predict_step(spec, other_plan, anchored, memory=False).seconds - predict_step(
            spec, other_plan, bare_profile, memory=False).seconds
        assert grown == pytest.approx(gain, abs=1e-9), other_plan.describe()
    assert getattr(anchor_step_overhead(cpu, spec, plan, bare / 2, steps=5), field) == 0.0
    with pytest.raises(CalibrationError, match="measured steps"):
        anchor_step_overhead(cpu, spec, plan, 0.0, steps=0)


@pytest.mark.pure
def test_run_times_are_the_latest_unbroken_run_of_the_plan():
    from interactive_parallel.cluster.telemetry import Telemetry
    from interactive_parallel.records import StepRecord
    from interactive_parallel.viz.plans import step_times

    t = Telemetry()

    def steps(plan: str, first: int, times: list[float], ranks: int = 2) -> None:
        for i, x in enumerate(times):
            t.add_step([StepRecord(rank=r, step=first + i, loss=1.0, tokens=8, time_s=x * (1 + r), plan=plan)
                        for r in range(ranks)])

    steps("dp4", 0, [9.0, 1.0, 1.0])        # another model's run (load_model restarts the steps)
    steps("dp4", 0, [5.0, 2.0, 3.0, 4.0])   # this model: the first step left out, the slowest rank
    assert t.run_times("dp4") == [4.0, 6.0, 8.0]
    assert step_times(t.history, "dp4") == [(0, 10.0), (1, 4.0), (2, 6.0), (3, 8.0)]  # the figure's points
    steps("tp4", 4, [1.0, 1.0])  # a later plan's steps are passed over
    assert t.run_times("dp4") == [4.0, 6.0, 8.0] and t.run_times("tp4") == [2.0]
    steps("dp4", 6, [7.0, 1.0, 1.0])
    assert t.run_times("dp4") == [2.0, 2.0]  # back to dp4: a new run


@pytest.mark.session
def test_live_calibration(session4):
    from interactive_parallel.cluster.calibration import calibrate
    from interactive_parallel.cluster.errors import SessionError
    from interactive_parallel.cluster.twins import run_sync

    s = session4
    assert s.spec is None
    with pytest.raises(SessionError, match="no model loaded"):
        run_sync(calibrate(s.ranks, s.spec, s.plan))
    s.load_model("tiny-llama")
    p = run_sync(calibrate(s.ranks, s.spec, s.plan))
    assert profile_problems(p) == []
    assert p.flops["fp32"] > 1e8 and p.flops["bf16"] > 0 and p.memory_bandwidth > 0 and p.op_overhead_s > 0
    for op, n in (("all_reduce", 2), ("all_reduce", 4), ("all_gather", 2), ("all_gather", 4),
                  ("reduce_scatter", 4), ("send", 2)):
        link = p.link("intra", op, n)
        assert (link.link, link.op, link.size) == ("intra", op, n)
        assert link.latency_s > 0 and link.bandwidth > 0
    assert not [x for x in p.links if x.link == "inter" and x.op != "*"]  # one host: nothing measured across
    assert 0.0 <= p.overlap <= 1.0 and p.device == "cpu" and p.devices_per_host == 4 and p.memory_bytes > 0
    assert "on 4 ranks" in p.source
    # The calibration's groups are gone and the world group still works.
    assert all(row.all_reduce_ok for row in s.doctor())
