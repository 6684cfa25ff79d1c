"""Where ranks listen (runtime.groups.net, runtime.groups.dist) and clocks across hosts (cluster.telemetry).

Pure: the address and interface choices, and moving records onto the client's clock.
Multirank: a spawned group (the start-up of torchrun and bench/) listens on loopback only,
the store included (it used to listen on every interface).
"""
from __future__ import annotations

import socket

import pytest

from interactive_parallel.cluster.telemetry import Telemetry
from interactive_parallel.records import CommRecord, PipelineEvent, StepRecord, TokenRecord
from interactive_parallel.runtime.groups import net
from mp_harness import run_ranks


def _loopback_name() -> str:
    return net.interface_of("127.0.0.1")


@pytest.mark.pure
def test_rendezvous_address_named_routed_or_loopback():
    lo = _loopback_name()
    assert net.rendezvous_address() == "127.0.0.1"
    assert net.rendezvous_address(toward="127.0.0.1") == "127.0.0.1"
    assert net.rendezvous_address(interface=lo) == "127.0.0.1"
    assert net.bind_interface("127.0.0.1") == (lo, "127.0.0.1")  # the interface toward rank 0
    assert net.bind_interface("10.0.0.9", interface=lo) == (lo, "127.0.0.1")  # named wins
    assert net.is_loopback("127.0.1.1") and net.is_loopback("localhost") and not net.is_loopback("10.1.2.3")


@pytest.mark.pure
def test_unknown_interface_names_those_there_are():
    with pytest.raises(ValueError, match=rf"no IPv4 address on interface 'nope0' .*interfaces: .*{_loopback_name()}"):
        net.address_of("nope0")


@pytest.mark.pure
def test_listener_binds_the_address_given_and_nothing_else():
    with net.listener("127.0.0.1") as s:
        host, port = s.getsockname()
        assert host == "127.0.0.1" and port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass


@pytest.mark.pure
def test_records_move_onto_the_client_clock_with_the_offsets_of_their_arrival():
    offsets = {1: 5.0}
    t = Telemetry(clock=lambda: dict(offsets))
    comm = lambda r, s: CommRecord(rank=r, step=0, op="all_reduce", bytes=4, start=s, end=s + 0.1)  # noqa: E731
    step = [StepRecord(rank=r, step=0, loss=1.0, tokens=1, time_s=0.1, comms=[comm(r, 100.0 + 5.0 * r)],
                       events=[PipelineEvent(rank=r, step=0, stage=r, microbatch=0, action="F",
                                             start=100.0 + 5.0 * r, end=100.2 + 5.0 * r)]) for r in (0, 1)]
    t.add_step(step)
    offsets[1] = 99.0  # measured again later: the step already held keeps the offsets it came with
    fixed, raw = t.timeline(), t.timeline(raw=True)
    assert [(r.rank, r.start) for r in fixed] == [(0, 100.0), (0, 100.0), (1, 100.0), (1, 100.0)]
    assert [(r.rank, r.start) for r in raw] == [(0, 100.0), (0, 100.0), (1, 105.0), (1, 105.0)]
    assert t.comms()[1].end == pytest.approx(100.1) and t.comms(raw=True)[1].end == pytest.approx(105.1)
    assert step[1].comms[0].start == 105.0  # the records as sent are not changed
    token = TokenRecord(rank=1, prompt=0, position=0, text="x", time=200.0)
    assert t.on_client_clock(token).time == 101.0  # offsets now: 99 s


def listeners(rank: int) -> dict:
    """This rank's listening sockets and the interface its group bound to (in a spawned group)."""
    import psutil

    from interactive_parallel.runtime.rank import state

    proc = psutil.Process()
    conns = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections(kind="inet")
    st = state.get()
    return {"listen": sorted({c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}),
            "interface": st.interface, "address": st.address}


@pytest.mark.multirank
def test_a_spawned_group_listens_on_loopback_only():
    out = run_ranks(listeners, 2)
    lo = _loopback_name()
    assert [(o["interface"], o["address"]) for o in out] == [(lo, "127.0.0.1")] * 2
    assert all(o["listen"] == ["127.0.0.1"] for o in out), out  # rank 0's store and gloo, rank 1's gloo
