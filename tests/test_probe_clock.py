"""The probes' clock (runtime/probes/clock.py) and what it times: the comm ledger and the compute
intervals, on the host clock (CPU) and on the device clock (CUDA), the latter driven here by a
stand-in event with torch.cuda.Event's interface over a device timeline the test moves by hand.
Also the memory record's activations (bytes saved for backward on every device) and its CUDA
allocator peak, and how the memory figure shows that peak."""
from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from interactive_parallel.records import MemoryRecord, from_dict
from interactive_parallel.runtime.probes import clock


class Timeline:
    """A device's streams: each record takes the device's time, which moves 1 ms per record and
    as the test says; an event completes when it, or a later one of its stream, is waited for."""

    def __init__(self):
        self.now = 0.0
        self.stream = "compute"
        self.recorded: list[FakeEvent] = []

    def event(self) -> "FakeEvent":
        return FakeEvent(self)


class FakeEvent:
    """torch.cuda.Event(enable_timing=True)'s interface and return types, on a Timeline."""

    def __init__(self, line: Timeline):
        self.line, self.t, self.stream, self.done = line, None, None, False

    def record(self, stream=None) -> None:
        self.line.now += 0.001
        self.t, self.stream, self.done = self.line.now, stream or self.line.stream, False
        self.line.recorded.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        upto = self.line.recorded.index(self)
        for ev in self.line.recorded[:upto + 1]:
            if ev.stream == self.stream:
                ev.done = True

    def elapsed_time(self, other: "FakeEvent") -> float:
        if not (self.done and other.done):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return float((other.t - self.t) * 1000.0)


@pytest.fixture
def line():
    return Timeline()


# ---------------------------------------------------------------- the clocks themselves

@pytest.mark.pure
def test_host_clock_marks_are_host_time():
    c = clock.HostClock()
    before = time.time()
    m = c.mark()
    c.settle()
    assert before <= c.resolve(m) <= time.time() and type(c.resolve(m)) is float
    assert isinstance(clock.for_device("cpu"), clock.HostClock)
    assert isinstance(clock.for_device(torch.device("meta")), clock.HostClock)


@pytest.mark.pure
def test_device_clock_resolves_marks_to_host_time_in_device_order(line):
    c = clock.DeviceClock(line.event)
    assert line.recorded[0].done  # the reference was waited for before the host time was read
    host0, ref_t = c._host, line.recorded[0].t
    line.now = 0.5
    a = c.mark()
    line.now = 1.25
    b = c.mark()
    line.stream = "pool"  # a future's callback runs on another stream, still running at settle
    other = c.mark()
    line.stream = "compute"
    last = c.mark()
    c.settle()
    assert not other.query()
    times = [c.resolve(m) for m in (a, b, other, last)]
    assert other.query()  # resolve waited for it
    assert all(type(t) is float for t in times)
    assert times == sorted(times)
    assert times[0] == pytest.approx(host0 + (a.t - ref_t))
    assert times[1] - times[0] == pytest.approx(0.75)


@pytest.mark.pure
def test_for_device_cuda_takes_the_event_factory(line, monkeypatch):
    monkeypatch.setattr(clock, "cuda_event", line.event)  # the default factory, looked up when built
    c = clock.for_device("cuda")
    assert isinstance(c, clock.DeviceClock) and line.recorded
    assert isinstance(clock.for_device(torch.device("cuda", 0), event=Timeline().event), clock.DeviceClock)


# ---------------------------------------------------------------- the comm ledger, one gloo rank

@pytest.fixture
def gloo():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def _ops(dist, line: Timeline | None, no_future, wait_at: float, settle_at: float):
    """A blocking all_reduce, an async broadcast waited on later, a functional all_reduce waited
    later, and an async broadcast never waited, inside one ledger; (records, host time just
    before the broadcast's wait)."""
    from interactive_parallel.runtime.probes import comms

    t = torch.arange(4.0)
    group_name = dist.group.WORLD.group_name
    c = clock.DeviceClock(line.event) if line is not None else None
    with comms.recording(0, 3, None, c) as ledger:
        dist.all_reduce(t)
        if line:
            line.now = 1.0
        work = dist.broadcast(t, 0, async_op=True)
        if line:
            line.now = wait_at
        before_wait = time.time()
        with no_future():
            work.wait()
        if line:
            line.now = 5.0
        y = torch.ops._c10d_functional.all_reduce(t, "sum", group_name)
        if line:
            line.now = 7.0
        torch.ops._c10d_functional.wait_tensor(y)
        dist.broadcast(t, 0, async_op=True)
        if line:
            line.now = settle_at
    return ledger.records, before_wait, c


@pytest.mark.rank1
def test_host_clock_ledger_is_as_before(gloo):
    import contextlib

    recs, before_wait, _ = _ops(gloo, None, contextlib.nullcontext, 0, 0)
    assert [(r.op, r.bytes, r.axis, r.group, r.dtype, r.step) for r in recs] == \
        [("all_reduce", 16, "world", [0], "float32", 3), ("broadcast", 16, "world", [0], "float32", 3),
         ("all_reduce", 16, "world", [0], "float32", 3), ("broadcast", 16, "world", [0], "float32", 3)]
    for r in recs:
        assert type(r.start) is float and type(r.end) is float and r.start <= r.end
    for a, b in zip(recs, recs[1:]):
        assert a.start <= b.start
    assert recs[0].end <= recs[1].start  # a blocking op ends before the next is issued
    json.dumps([r.to_dict() for r in recs])


@pytest.mark.rank1
def test_device_clock_ends_an_op_at_its_wait(gloo, line, monkeypatch):
    import contextlib

    @contextlib.contextmanager
    def no_future():
        yield

    # gloo completes a broadcast's future on its own thread at a time the test cannot set: here its
    # Work has none, as a backend's Work may not, so the wait is what ends it
    def no_future_here(self):
        raise RuntimeError("no future")

    monkeypatch.setattr(gloo.Work, "get_future", no_future_here)
    recs, _, c = _ops(gloo, line, no_future, wait_at=3.0, settle_at=9.0)
    host0 = c._host
    ref_t = line.recorded[0].t
    to_host = lambda device_t: host0 + device_t - ref_t  # noqa: E731
    blocking, waited, functional, never = recs
    assert blocking.end == pytest.approx(blocking.start, abs=0.0015)  # marked right after the call
    assert waited.start == pytest.approx(to_host(1.001), abs=1e-6)
    assert waited.end == pytest.approx(to_host(3.001), abs=1e-6)  # at the wait, not at issue
    assert functional.start == pytest.approx(to_host(5.001), abs=1e-6)
    assert functional.end == pytest.approx(to_host(7.001), abs=1e-6)  # at wait_tensor
    assert never.end == pytest.approx(to_host(9.001), abs=1e-6)  # the step's end mark
    for r in recs:
        assert type(r.start) is float and type(r.end) is float and r.end >= r.start
    json.dumps([r.to_dict() for r in recs])


@pytest.mark.pure
def test_device_clock_takes_the_earliest_end_mark_and_a_batch_ends_with_its_work(line):
    from interactive_parallel.runtime.probes.ledger import Ledger

    t = torch.ones(2)
    ledger = Ledger(0, 0, None, clock.DeviceClock(line.event))
    done = ledger.note("all_reduce", "all_reduce", {"tensors": [t]}, None)
    line.now = 2.0
    ledger.finish(done)  # e.g. the future's callback
    line.now = 4.0
    ledger.finish(done)  # then its wait: later on the device, not the end
    ledger.begin_batch()  # batch_isend_irecv on NCCL: launched together at the batch's end
    line.now = 5.0
    send = ledger.note("send", "send", {"tensors": [t], "dst": 1}, None)
    recv = ledger.note("recv", "recv", {"tensors": [t], "src": 1}, None)
    ledger.issued(send, None, blocking=True)  # an op's own end inside a batch is not its end
    batch_work = object()
    ledger.end_batch(batch_work)
    line.now = 6.0
    ledger.waited(batch_work)
    line.now = 8.0
    recs = ledger.close()
    host0, ref_t = ledger.clock._host, line.recorded[0].t
    assert recs[0].end - recs[0].start == pytest.approx(2.0 - 0.001, abs=1e-6)
    assert [r.op for r in recs] == ["all_reduce", "send", "recv"]
    for r in (send, recv):
        assert r.end == pytest.approx(host0 + 6.001 - ref_t, abs=1e-6)
    ledger.finish(done)  # after the step: ignored
    assert recs[0].end - recs[0].start == pytest.approx(1.999, abs=1e-6)


@pytest.mark.rank1
def test_batch_hooks_are_installed_and_gloo_still_refuses_batches(gloo):
    from interactive_parallel.runtime.probes import comms

    comms.install()
    assert gloo.ProcessGroup._start_coalescing is comms._patched_start_coalescing
    with comms.recording(0, 0) as ledger, pytest.raises(RuntimeError, match="startCoalescing"):
        gloo.group.WORLD._start_coalescing(torch.device("cpu"))
    assert ledger._coalescing == []


# ---------------------------------------------------------------- compute intervals and the step probe

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.pure
def test_compute_intervals_on_the_device_clock_resolve_in_order(line):
    from interactive_parallel.runtime.probes import pipeline

    model = Tiny()
    pipeline.instrument_module(model)
    c = clock.DeviceClock(line.event)
    with pipeline.recording(0, 1, c) as events:
        for _ in range(2):
            model(torch.randn(3, 8)).sum().backward()
        assert events.events == []  # resolved when the step ends
    evs = events.events
    assert [(e.action, e.microbatch) for e in evs] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    for e in evs:
        assert type(e.start) is float and type(e.end) is float and e.start < e.end
    for a, b in zip(evs, evs[1:]):
        assert a.end <= b.start
    assert evs[0].start > c._host


@pytest.mark.pure
def test_compute_intervals_on_the_host_clock():
    from interactive_parallel.runtime.probes import pipeline

    model = Tiny()
    pipeline.instrument_module(model)
    t0 = time.time()
    with pipeline.recording(0, 0) as events:
        model(torch.randn(3, 8)).sum().backward()
    (f, b) = events.events
    assert (f.action, b.action) == ("F", "B") and t0 <= f.start <= f.end <= b.start <= b.end <= time.time()


class FakePar:
    """What probes.step reads of a Parallelized, around one small module."""

    def __init__(self, device: str):
        from interactive_parallel import Plan

        self.plan, self.raw, self.device = Plan(), Tiny(), torch.device(device)
        self.schedule = self.cp_model = None
        self.measured_bytes: dict = {}

    def parameters(self):
        return list(self.raw.parameters())


@pytest.fixture
def saved(monkeypatch):
    """Every SavedTensors the probes open, kept for the test to read."""
    from interactive_parallel.runtime.probes import memory

    opened = []

    class Spy(memory.SavedTensors):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            opened.append(self)

    monkeypatch.setattr(memory, "SavedTensors", Spy)
    return opened


def _probed_step(par, step=0):
    from interactive_parallel.runtime import probes

    opt = torch.optim.AdamW(par.raw.parameters(), lr=1e-3)
    with probes.step(par, opt, step, 0) as p:
        par.raw(torch.randn(32, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return p.records()


@pytest.mark.pure
def test_cpu_step_activations_are_saved_tensors_and_no_device_peak(saved, monkeypatch):
    from interactive_parallel.runtime.probes import memory

    monkeypatch.setattr(memory, "DevicePeak", lambda *a: pytest.fail("DevicePeak on CPU"))
    mem, comms_, events = _probed_step(FakePar("cpu"))
    assert len(saved) == 1 and saved[0].peak > 0
    assert mem.activations == saved[0].peak and mem.device_peak == 0 and mem.device == "cpu"
    assert comms_ == [] and [e.action for e in events] == ["F", "B"]


@pytest.mark.pure
def test_cuda_step_measures_saved_tensors_and_the_allocator_peak_beside(saved, line, monkeypatch):
    """probes.step's CUDA branch, run on CPU: the device clock over stand-in events and a
    stand-in allocator peak (the device type is all the branch reads)."""
    from interactive_parallel.runtime.probes import memory

    class Peak:
        def __init__(self, device):
            assert device.type == "cuda"
            self.peak = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.peak = 12_345

    monkeypatch.setattr(memory, "DevicePeak", Peak)
    monkeypatch.setattr(clock, "cuda_event", line.event)
    par = FakePar("cuda")
    mem, _, events = _probed_step(par)
    cpu_mem, _, _ = _probed_step(FakePar("cpu"))
    assert mem.activations == saved[0].peak == cpu_mem.activations  # the same quantity on both devices
    assert mem.device_peak == 12_345 and mem.device == "cuda"
    assert [e.action for e in events] == ["F", "B"] and all(type(e.start) is float for e in events)
    assert events[0].end <= events[1].start
    later, _, _ = _probed_step(par, step=1)  # a step between measurements reports the last counts
    assert (later.activations, later.device_peak) == (mem.activations, 12_345)


# ---------------------------------------------------------------- the record and the figure

@pytest.mark.pure
def test_memory_record_round_trips_with_the_device_peak():
    m = MemoryRecord(rank=1, step=2, params=10, grads=10, optimizer=20, activations=5, rss=7, device="cuda",
                     device_peak=99)
    d = m.to_dict()
    assert d["device_peak"] == 99 and list(d)[-2:] == ["device_peak", "kind"]
    assert MemoryRecord.from_dict(d) == m and from_dict(json.loads(json.dumps(d))) == m
    old = {k: v for k, v in d.items() if k != "device_peak"}  # a record from before the field
    assert MemoryRecord.from_dict(old).device_peak == 0
    assert MemoryRecord(1, 2, 3, 4, 5, 6, 7, "cpu").device_peak == 0  # positional order kept


@pytest.mark.pure
def test_memory_figure_names_the_device_peak_only_where_measured():
    from interactive_parallel.viz import memory_figure

    MiB = 1024 ** 2
    cpu = [MemoryRecord(rank=r, step=0, params=MiB, grads=MiB, optimizer=2 * MiB, activations=MiB) for r in range(2)]
    fig = memory_figure(cpu)
    assert all(len(row) == 3 for t in fig.data for row in t.customdata)
    assert all("device peak" not in t.hovertemplate for t in fig.data)
    cuda = [MemoryRecord(rank=0, step=0, params=MiB, grads=MiB, optimizer=2 * MiB, activations=MiB, device="cuda",
                         device_peak=5 * MiB), cpu[1]]
    fig = memory_figure(cuda)
    for t in fig.data:
        assert t.hovertemplate.endswith("%{customdata[3]}<extra></extra>")
        assert "5 MiB" in t.customdata[0][3] and t.customdata[1][3] == ""
