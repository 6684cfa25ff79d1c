"""Calibration, rank side: time matmuls, elementwise ops and collectives as a step runs them.

Owns the measuring behind Session.calibrate: every rank runs `calibrate(options)` at the same
time and returns its own CalibrationSamples (plan/calibration.py fits a HardwareProfile to the
slowest rank's). Every rank measures while its peers do the same work, as in a step, where
ranks share the host's cores and memory: matmuls and elementwise ops are timed back to back
in batches long enough for that sharing to show, elementwise ops forward and backward under
autograd as training runs them. A collective is timed right after a compute burst on every
rank (its cost: burst + call minus the burst), all groups of one size busy at once, because
in a step a collective also waits for the slowest rank's compute. Groups are made with
new_group on every rank in one order and destroyed after (runtime.calibration.measure); the pipeline and
core-handoff measurements are runtime.calibration.calibrate_pipeline's. Knows nothing of the client, of
models (the options carry the shapes) or of how the samples are fitted.
"""
from __future__ import annotations

import contextlib
import statistics
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...records.calibration import OVERLAP_BOTH, OVERLAP_COLLECTIVE, OVERLAP_MATMUL, CalibrateOptions
from ...records.hardware import CalibrationSample
from ..groups.dist import torch_device
from ..rank import state as _state
from .calibrate_pipeline import handoff_bursts, pipeline_steps
from .measure import Timer, first_ranks_figure, layouts, link_class, my_group

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# torch 2.13 renamed the tensor forms (the old names warn); older torch has only those.
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_COLLECTIVE_TIMES = 3
"""Collectives are timed this many times `repeats`: ranks time-sharing cores make their times
vary far more than a matmul's."""
MODEL_LAYERS = (1, 3)
"""Decoder layers of the two timed model steps: their difference is (3 - 1) blocks, long enough
against a step's noise on a small model."""
_FLOAT = 4  # bytes of an fp32 element: every buffer here is fp32 (autocast casts inside the matmul)


def calibrate(options: CalibrateOptions, spec=None) -> list[CalibrationSample]:
    """This rank's samples: matmuls, elementwise chains, training steps of `spec` (a ModelSpec) cut to
    one and to three decoder layers, collectives, overlap, pipeline steps (a collective call:
    every rank of the default group runs it with the same options)."""
    st = _state.get()
    world = dist.get_world_size()
    problems = options.problems(world)
    if problems:
        raise ValueError(f"rank {st.rank}: calibrate options refused: " + "; ".join(problems))
    device = torch_device(st.device, st.gpu)
    timer = Timer(device)
    hosts: list = [None] * world
    dist.all_gather_object(hosts, st.host)
    rank = dist.get_rank()
    with torch.no_grad():
        samples = _matmuls(options, timer, rank, device)
    samples += _elementwise(options, timer, rank, device)
    burst = _burst(options, device)
    if spec is not None and options.rows:
        steps, burst = _model_steps(spec, options, timer, rank, device)
        samples += steps
    with torch.no_grad():
        samples += _collectives(options, timer, rank, world, hosts, device, burst)
        samples += _overlap(options, timer, rank, world, hosts, device)
    if options.pipeline:
        samples += pipeline_steps(options, timer, rank, world, hosts, device)
        if world % 2 == 0:
            samples += handoff_bursts(options, timer, rank, world, device, _burst(options, device))
    return samples


def _autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in _DTYPES:
        raise ValueError(f"precision {precision!r} is not 'fp32', 'bf16' or 'fp16'")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("precision 'fp16' is CUDA only (the plans refuse it on a CPU too)")
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def _matmuls(options: CalibrateOptions, timer: Timer, rank: int, device: torch.device) -> list[CalibrationSample]:
    out = []
    for precision in options.precisions:
        for tokens in options.tokens:
            for fan_in, fan_out in options.shapes:
                x = torch.randn(tokens, fan_in, device=device)
                w = torch.randn(fan_out, fan_in, device=device)
                with _autocast(device, precision):
                    seconds = timer.per_call(lambda: F.linear(x, w), options.repeats, options.batch_s)
                size = 2 if precision in _DTYPES else _FLOAT
                out.append(CalibrationSample(
                    rank=rank, what="matmul", name=f"mm {tokens}x{fan_in}x{fan_out} {precision}", seconds=seconds,
                    flops=2 * tokens * fan_in * fan_out, precision=precision,
                    bytes=size * (tokens * fan_in + fan_in * fan_out + tokens * fan_out)))
    return out


def chain_ops(pairs: int = 4) -> int:
    """aten operations of one `elementwise_chain(pairs)` call once its gradients exist, as a
    dispatch mode counts them (tests/test_calibration.py checks it against one): six per
    multiply-add pair (two forward; backward the multiply's two gradients and the adds that
    sum and accumulate them), four for the sum, its backward (ones_like, expand) and one more
    accumulation."""
    return 6 * pairs + 4


def elementwise_chain(n: int, device: torch.device, pairs: int = 4) -> Callable[[], None]:
    """`pairs` multiply-adds of `n` elements run forward and backward with autograd."""
    a = torch.randn(n, device=device, requires_grad=True)
    b = torch.randn(n, device=device, requires_grad=True)

    def chain() -> None:
        y = a
        for _ in range(pairs):
            y = y * b + a
        y.sum().backward()

    chain()  # the gradients exist from here on, so every later call accumulates into them
    return chain


def _elementwise(options: CalibrateOptions, timer: Timer, rank: int, device: torch.device) -> list[CalibrationSample]:
    """Per aten operation, an elementwise chain run forward and backward with autograd, as a
    step runs its norms and activations: the fixed cost of one operation in training
    (dispatch, autograd, its engine) is several times that of one add without autograd,
    measured. Operations are counted as plan.steptime counts a block's (aten operations);
    each reads two tensors and writes one (`bytes`)."""
    out = []
    for n in options.op_sizes:
        seconds = timer.per_call(elementwise_chain(n, device), options.repeats, options.batch_s) / chain_ops()
        out.append(CalibrationSample(rank=rank, what="op", name=f"elementwise {n} fwd+bwd", seconds=seconds,
                                     bytes=3 * n * _FLOAT))
    return out


def _collectives(options: CalibrateOptions, timer: Timer, rank: int, world: int, hosts: list,
                 device: torch.device, burst: Callable[[], object]) -> list[CalibrationSample]:
    sizes = options.group_sizes or tuple(n for n in range(2, world + 1) if world % n == 0)
    out = []
    for n in sizes:
        for label, groups in layouts(world, n):
            with my_group(groups, rank) as (mine, pg):
                link = link_class(mine, hosts)
                for op in options.ops:
                    if op == "send" and n != 2:
                        continue
                    for nbytes in options.byte_sizes:
                        call = _call(op, nbytes, mine, pg, rank, device)
                        seconds = _after_burst(timer, burst, call, options.repeats)
                        out.append(CalibrationSample(
                            rank=rank, what="collective", name=f"{op} g{n} {label} {link} {nbytes}",
                            seconds=seconds, bytes=_full_bytes(nbytes, n), op=op, size=n, link=link))
                        if op == "send":
                            seconds = _to_waiting_receiver(timer, burst, nbytes, mine, pg, rank, device,
                                                           options.repeats)
                            out.append(CalibrationSample(
                                rank=rank, what="collective", name=f"recv g{n} {label} {link} {nbytes}",
                                seconds=seconds, bytes=_full_bytes(nbytes, n), op="recv", size=n, link=link))
    return out


def _to_waiting_receiver(timer: Timer, burst: Callable[[], object], nbytes: int, group: list[int], pg, rank: int,
                         device: torch.device, repeats: int) -> float:
    """Median seconds a message takes to a receiver already waiting for it, a pipeline's case
    (the schedule's replay holds the wait for the sender's compute; `send` after a burst on both
    sides holds the skew between two busy ranks too): the group's first rank computes a burst,
    then times the message and its echo from the second rank, which only waits and answers,
    and halves it. Both ranks report the first rank's figure."""
    first, second = group
    buf = torch.ones(_full_bytes(nbytes, 2) // _FLOAT, device=device)
    times = []
    dist.barrier()
    for i in range(_COLLECTIVE_TIMES * repeats + 1):
        if rank == first:
            burst()
            t0 = timer.now()
            dist.send(buf, dst=second, group=pg)
            dist.recv(buf, src=second, group=pg)
            if i:
                times.append((timer.now() - t0) / 2)
        else:
            dist.recv(buf, src=first, group=pg)
            dist.send(buf, dst=first, group=pg)
    return first_ranks_figure(times, first, pg, device)


def _model_steps(spec, options: CalibrateOptions, timer: Timer, rank: int,
                 device: torch.device) -> tuple[list[CalibrationSample], Callable[[], object]]:
    """Training steps (forward, backward, AdamW) of `spec` cut to MODEL_LAYERS decoder layers, on
    `options.rows` sequences: their difference is its blocks as the runtime's code runs them
    (transformers' modules, autograd, the optimizer), the one-layer step less it the rest. Returns
    the samples and the one-layer model's forward and backward, the burst before each collective:
    in a step a collective follows that much work, and waits there for the slowest rank."""
    import dataclasses

    from ..model.models import build_model

    key = "n_layer" if "n_layer" in spec.config else "num_hidden_layers"
    batch = torch.randint(0, spec.vocab_size, (options.rows, options.seq_len + 1), device=device)
    out, burst = [], None
    for layers in MODEL_LAYERS:
        model = build_model(dataclasses.replace(spec, config={**spec.config, key: layers}, source=None), device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

        def forward_backward(model=model) -> None:
            with torch.enable_grad():  # also as the burst, between collectives timed under no_grad
                model(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss.backward()

        def step(model=model, opt=opt, fb=forward_backward) -> None:
            fb()
            opt.step()
            opt.zero_grad(set_to_none=True)

        seconds = timer.per_call(step, 2 * options.repeats, options.batch_s)
        out.append(CalibrationSample(rank=rank, what="step", name=f"step {layers} layer(s) {options.rows}x{options.seq_len}",
                                     seconds=seconds, size=layers, precision="fp32"))
        if layers == 1:
            burst = forward_backward
    return out, burst


def _burst(options: CalibrateOptions, device: torch.device) -> Callable[[], object]:
    tokens, fan_in, fan_out = options.burst
    x, w = torch.randn(tokens, fan_in, device=device), torch.randn(fan_out, fan_in, device=device)
    return lambda: F.linear(x, w)


def _after_burst(timer: Timer, burst: Callable[[], object], call: Callable[[], object], repeats: int) -> float:
    """Median seconds a collective takes right after a compute burst on every rank ((burst +
    call) minus the burst, on one rank), rounds of the two run back to back from one barrier,
    as a tensor-parallel step alternates them: the call waits there for the slowest rank's
    burst, and the groups of a layout run side by side."""
    dist.barrier()
    return timer.median(call, _COLLECTIVE_TIMES * repeats, before=burst)


def _full_bytes(nbytes: int, n: int) -> int:
    """`nbytes` rounded down to whole fp32 elements that split evenly over `n` ranks."""
    return max(nbytes // (_FLOAT * n), 1) * n * _FLOAT


def _call(op: str, nbytes: int, group: list[int], pg, rank: int, device: torch.device) -> Callable[[], object]:
    """One call of `op` on `pg` with a full buffer of `nbytes` (all_gather's output,
    reduce_scatter's input); 'send': the group's first rank sends to its second."""
    n = len(group)
    numel = _full_bytes(nbytes, n) // _FLOAT
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=pg)
    if op == "all_gather":
        return lambda: _GATHER(full, part, group=pg)
    if op == "reduce_scatter":
        return lambda: _SCATTER(part, full, group=pg)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=pg)
    if op == "send":
        if rank == group[0]:
            return lambda: dist.send(full, dst=group[1], group=pg)
        return lambda: dist.recv(full, src=group[0], group=pg)
    raise ValueError(f"collective {op!r} is not one calibrate times")


def _overlap(options: CalibrateOptions, timer: Timer, rank: int, world: int, hosts: list,
             device: torch.device) -> list[CalibrationSample]:
    """A compute burst alone, an all_reduce of the world alone, and the all_reduce started
    asynchronously before the burst and waited for after it, interleaved. The burst is as many
    matmuls as take about the all_reduce's time (the same count on every rank): the share
    hidden is read against the shorter of the two, so a short one would leave it all noise."""
    one = _burst(options, device)
    buf = torch.ones(_full_bytes(options.overlap_bytes, world) // _FLOAT, device=device)
    t_ar = timer.median(lambda: dist.all_reduce(buf), options.repeats, dist.barrier)
    t_one = timer.per_call(one, options.repeats, options.batch_s)
    count = torch.tensor([min(max(round(t_ar / max(t_one, 1e-9)), 1), 10_000)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    k = int(count.item())

    def burst() -> None:
        for _ in range(k):
            one()

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        burst()
        work.wait()

    fns = {OVERLAP_MATMUL: burst, OVERLAP_COLLECTIVE: lambda: dist.all_reduce(buf), OVERLAP_BOTH: both}
    times: dict[str, list[float]] = {op: [] for op in fns}
    for i in range(_COLLECTIVE_TIMES * options.repeats + 1):
        for op, fn in fns.items():
            dist.barrier()
            t0 = timer.now()
            fn()
            t1 = timer.now()
            if i:
                times[op].append(t1 - t0)
    link = link_class(list(range(world)), hosts)
    tokens, fan_in, fan_out = options.burst
    nbytes = buf.numel() * _FLOAT
    return [CalibrationSample(rank=rank, what="collective", name=f"{op} g{world} {link} {nbytes}",
                              seconds=statistics.median(times[op]), op=op, size=world, link=link, bytes=nbytes,
                              flops=2 * k * tokens * fan_in * fan_out) for op in fns]
