"""A local session is this user's alone, and its timeline is on one clock.

Every socket of the session (controller, schedulers, engines, the store, gloo) listens on
127.0.0.1; its connection files are readable by their owner only and its messages are
signed; a rank whose clock is off is measured and its records corrected; the interface
option binds the group where it says and refuses a name no rank has, before any rendezvous.
(Across hosts: tests/test_multihost.py.)
"""
from __future__ import annotations

import json
import os
import stat

import psutil
import pytest

from conftest import live_session
from interactive_parallel import Plan, Session
from interactive_parallel.cluster import SessionError
from interactive_parallel.records import CommRecord
from interactive_parallel.runtime.groups import net

pytestmark = pytest.mark.session

SMALL = dict(batch_size=8, seq_len=32)


@pytest.fixture(scope="module")
def session2():
    with live_session(2) as s:
        yield s


def listening(session) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every socket any process of the session listens on."""
    pool = session.ranks.pool
    pids = set(pool.process_tree()) | {pool._leash.pid}
    return [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
            if c.pid in pids and c.status == psutil.CONN_LISTEN]


def test_every_socket_of_a_local_session_listens_on_loopback(session2):
    s = session2
    s.load_model("tiny-llama")
    s.apply(Plan(dp=2, **SMALL))
    s.train(steps=1)
    socks = listening(s)
    engines = set(s.ranks.pool.engine_pids())
    assert {pid for pid, _, _ in socks} >= engines  # every rank listens (gloo), so this sees them
    assert len([1 for pid, _, _ in socks if pid in engines]) >= len(engines) + 1  # and rank 0's store
    others = [sock for sock in socks if sock[1] != "127.0.0.1"]
    assert not others, f"listening beyond loopback: {others}"
    assert {(r.interface, r.address) for r in s.ranks_info} == {(net.interface_of("127.0.0.1"), "127.0.0.1")}


def test_connection_files_are_the_owners_and_messages_are_signed(session2):
    pool = session2.ranks.pool
    assert stat.S_IMODE(os.stat(pool.profile_dir).st_mode) == 0o700
    security = os.path.join(pool.profile_dir, "security")
    files = sorted(os.listdir(security))
    assert any(f.endswith("-client.json") for f in files) and any(f.endswith("-engine.json") for f in files)
    for f in files:
        assert stat.S_IMODE(os.stat(os.path.join(security, f)).st_mode) == 0o600, f
        info = json.load(open(os.path.join(security, f)))
        if f.endswith(("-client.json", "-engine.json")):
            assert info["signature_scheme"].startswith("hmac-") and len(info["key"]) >= 32, f
            assert info["interface"] == "tcp://127.0.0.1", f
    assert pool.client.session.auth is not None and pool.client.session.key  # signing on in the client


def _clock_ahead(seconds: float, rank: int) -> None:
    """On `rank`: time.time() runs `seconds` ahead (0: back to the real clock)."""
    import time

    from interactive_parallel.runtime.rank import state

    real = getattr(time, "_ip_real_time", time.time)
    time._ip_real_time = real
    if state.get().rank == rank:
        time.time = (lambda: real() + seconds) if seconds else real


def test_a_rank_clock_that_is_off_is_measured_and_corrected(session2):
    s = session2
    s.load_model("tiny-llama")
    s.apply(Plan(dp=2, **SMALL))
    try:
        s.run(_clock_ahead, 30.0, 1)
        clocks = s.measure_clocks()
        assert abs(clocks[1].offset_s - 30.0) <= 0.25 and abs(clocks[0].offset_s) <= 0.25, clocks
        s.train(steps=1)
    finally:
        s.run(_clock_ahead, 0.0, 1)
        s.measure_clocks()
    last = lambda records: {r: max(c.end for c in records if c.rank == r) for r in (0, 1)}  # noqa: E731
    fixed = last([c for c in s.timeline() if isinstance(c, CommRecord)])
    raw = last(s.comms(raw=True))
    # the step's last collective (the gradient all-reduce) ends on both ranks at about one moment
    assert abs(fixed[1] - fixed[0]) <= 1.0 and raw[1] - raw[0] >= 29.0, (fixed, raw)
    assert str(s.clocks()).splitlines()[0].split() == ["rank", "host", "offset_s", "rtt_s"]


def test_named_interface_binds_there_and_an_unknown_one_is_refused_before_rendezvous():
    lo = net.interface_of("127.0.0.1")
    with Session(ranks=2, interface=lo) as s:
        assert {r.interface for r in s.ranks_info} == {lo}
        assert all(r.all_reduce_ok and r.interface == lo for r in s.doctor())
    with pytest.raises(SessionError, match=rf"interface 'nope0' has no IPv4 address on rank 0 .*{lo}"):
        Session(ranks=2, interface="nope0")
    with pytest.raises(ValueError, match="interface"):
        Session(ranks=2, interface="")
