"""Faults on purpose under every plan: each injected inside a rank (Session.inject) on 4 live
ranks (tiny-llama, batch 8x32, gloo), with a short collective timeout (TIMEOUT_S = 5 s).

For every fault (raise, kill, hang, skip_collective, slow) under dp4, fsdp4, dp2xtp2 and
pp2xdp2 during train, and kill / hang during generate and serve (our engine and
transformers'):
- the RankError names the faulty rank and the injected fault, as what it is (a dead engine, a
  rank hung past the collective timeout, the rank's own exception); a slow rank raises nothing
  and slows the step by at least its `seconds`;
- a hang's error says where the ranks were (err.where, err.mismatch): the hung rank's stack, and
  (but under pp) the group on which the flight recorder shows it behind its peers; a rank that
  skips an all_reduce in a user's `run` is named with the sequence number it never issued;
- no process is left waiting: after the next call no call is pending and the pool's engine
  processes are exactly the ranks';
- the next call works, and what it starts from is what docs/faults.md's "What it survives"
  table says (KEPT): a raised rank -> every rank's own shards (weights, AdamW state, step of
  the last completed step); a dead, hung or collective-skipping rank -> the newest snapshot.
  The oracle is parity: the steps after the failure have the losses of one uninterrupted
  single-process run (LOSS_TOL = 1e-5), generation and serving the texts of before.
Every case starts from the seed (load_model), snapshot at step 2, fault at the boundary of
step 3 or inside its second collective. The seconds from each fault firing to its error
reaching the caller land in artifacts/faults.md beside the time the design aims at (LIMITS:
kill and raise 10 s, a hang or a skipped collective TIMEOUT_S + 10 s), and docs/faults.md's table
quotes them: a benchmark's figures, which no assertion bounds (how fast a loaded machine
answers is not what a test decides).
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest

from conftest import alive, live_session, single_process_losses, step_losses
from interactive_parallel import Plan, Request
from interactive_parallel.cluster import RankError

pytestmark = pytest.mark.faults

TIMEOUT_S = 5.0
KILL_LIMIT_S = 10.0
HANG_LIMIT_S = TIMEOUT_S + 10.0
LIMITS = {"kill": KILL_LIMIT_S, "raise": KILL_LIMIT_S, "hang": HANG_LIMIT_S, "skip_collective": HANG_LIMIT_S}
LOSS_TOL = 1e-5
BATCH = dict(batch_size=8, seq_len=32)
SLOW_S = 2.0
PLANS = {"dp4": dict(dp=4), "fsdp4": dict(fsdp=4), "dp2xtp2": dict(dp=2, tp=2), "pp2xdp2": dict(pp=2, dp=2),
         "pp2xdp2-zbv": dict(pp=2, dp=2, pp_schedule="zbv"), "cp2xdp2-ring": dict(cp=2, dp=2, cp_method="ring")}
VICTIM = {"dp4": 1, "fsdp4": 2, "dp2xtp2": 3, "pp2xdp2": 2, "pp2xdp2-zbv": 1, "cp2xdp2-ring": 1}
WHERE = {"dp4": "step", "fsdp4": "step", "dp2xtp2": "collective", "pp2xdp2": "collective", "pp2xdp2-zbv": "collective",
         "cp2xdp2-ring": "collective"}
"""At the step boundary, or inside the step's second collective (collective=1)."""
FAULTS = ("raise", "kill", "hang", "skip_collective", "slow")
KEPT = {"raise": "kept", "kill": "snapshot", "hang": "snapshot", "skip_collective": "snapshot"}
"""Where the state after each fault comes from (docs/faults.md's table says the same)."""
PROMPTS = ["12+35=", "7+8=", "40+2=", "3+3="]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
MEASURED: list[dict] = []


@pytest.fixture(scope="module")
def session():
    with live_session(4, collective_timeout=TIMEOUT_S) as s:  # stopped: nothing left behind
        yield s
    _write_figures()


@pytest.fixture(scope="module")
def reference():
    """Per-step losses of one uninterrupted single-process run."""
    return single_process_losses(8, **BATCH)



def _fresh(s, plan: str) -> None:
    """From the seed under `plan`, two steps trained, the newest snapshot at step 2."""
    s.load_model("tiny-llama")
    s.apply(Plan(**PLANS[plan], **BATCH))
    s.train(2, snapshot_every=2)


def _fails(call, fault: str, victim: int, s) -> tuple[RankError, float]:
    """The RankError `call` raises, and seconds from the fault firing (its record's time on
    this client's clock) to the error reaching the caller (recorded, not bounded)."""
    with pytest.raises(RankError) as caught:
        call()
    seen = time.time()
    fired = [f for f in s.ranks.fired if f.rank == victim and f.fault == fault]
    assert fired, f"the {fault} fault on rank {victim} never announced itself: {s.ranks.fired}"
    return caught.value, seen - fired[0].time


def _check_named(err: RankError, fault: str, victim: int) -> None:
    """The error names the rank and, on its fault line, the injected fault with the rank it
    was injected on. A skipped collective shifts every later one on that rank against its
    peers': gloo may abort a process on the first mismatched pair (the error then names that
    dead rank first), or a peer ends up blocked the longest (named as hung); the fault line
    names the rank that skipped."""
    text = str(err)
    if fault == "skip_collective" and err.ename in ("EngineDied", "RankHung"):
        assert f"rank {err.rank}" in text.splitlines()[0]
    else:
        assert err.rank == victim, text[:1500]
    assert f"{fault} on rank {victim}" in err.fault and f"injected fault: {fault} on rank {victim}" in text
    if fault == "raise":
        assert err.ename == "InjectedFault" and "InjectedFault" in err.traceback
    elif fault == "kill":
        assert err.ename == "EngineDied"
    elif fault == "hang":
        assert err.ename == "RankHung"  # found by the collective timeout, as docs/faults.md says


def _check_where(err: RankError, victim: int, by_sequence: bool) -> None:
    """A hang as it shows: the hung rank's stack, still running, is in the fault's sleep; and (by_sequence)
    on the group where the ranks first disagree, the flight recorder's sequence numbers show the hung
    rank behind, never having issued the collective its peers wait in. Not under pp: gloo's recorder
    leaves out send / recv, so a stage waiting on the hung stage's send is behind too, and may be first."""
    assert f"rank {victim} still running:" in err.where and "in _fire" in err.where, err.where
    if not by_sequence:
        return
    found = err.mismatch
    assert found is not None and victim in found.members and victim in found.behind, err.where
    assert all(found.behind[r] < found.seq for r in found.behind), err.where
    assert {c.rank for c in err.collectives} == {0, 1, 2, 3} and victim in {x.rank for x in err.stacks}
    assert f"first mismatch on group {found.group!r}" in err.where and f"rank(s) {sorted(found.behind)} never" in err.where


def _nothing_waits(s) -> None:
    """No call pending, and the pool runs exactly the ranks' engine processes."""
    assert not s.ranks.caller.pending
    pool = s.ranks.pool
    engines = {pid for pid in pool.engine_pids() if alive(pid)}
    assert engines == {r.pid for r in s.ranks_info}, (engines, s.ranks_info)


def _next_call(s, call):
    """The call after a failure (replacing ranks warns, saying which); its result and seconds."""
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = call()
    return out, time.monotonic() - t0


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("plan", list(PLANS))
def test_fault_during_train(session, reference, plan, fault):
    s, victim, where = session, VICTIM[plan], WHERE[plan]
    _fresh(s, plan)
    s.inject(victim, fault, at_step=1, where=where, collective=1, seconds=SLOW_S if fault == "slow" else 0.0)
    if fault == "slow":
        recs = s.train(3, snapshot_every=2)
        assert [f.rank for f in s.ranks.fired] == [victim]
        waited = max(r.time_s for r in recs if r.step == 3)
        assert waited >= 0.9 * SLOW_S, waited  # its peers waited for it inside the step
        assert all(abs(v - reference[k]) <= LOSS_TOL for k, v in step_losses(recs).items())
        MEASURED.append(dict(call="train", plan=plan, fault=fault, where=where, named="-", seconds=waited,
                             kept="everything", next_s=0.0))
        return
    err, latency = _fails(lambda: s.train(3, snapshot_every=2), fault, victim, s)
    _check_named(err, fault, victim)
    if fault == "hang":
        _check_where(err, victim, "pp" not in plan)
    resumed, next_s = _next_call(s, lambda: s.train(2, snapshot_every=2))
    _nothing_waits(s)
    first = 3 if KEPT[fault] == "kept" else 2
    assert s.model.restored.state == KEPT[fault] and s.model.restored.step == first, s.model.restored
    losses = step_losses(resumed)
    assert sorted(losses) == [first, first + 1]
    assert all(abs(v - reference[k]) <= LOSS_TOL for k, v in losses.items()), (losses, reference)
    MEASURED.append(dict(call="train", plan=plan, fault=fault, where=where, named=err.ename, seconds=latency,
                         kept=KEPT[fault], next_s=next_s))


def _skip_all_reduce_on(victim: int) -> float:
    """Every rank all_reduces once; then each rank but `victim` all_reduces again, an all_reduce
    `victim` skips (as a user's function that skips one on one rank)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() != victim:
        dist.all_reduce(t)
    return t.item()


def test_a_skipped_all_reduce_is_shown_as_the_mismatch_it_is(session):
    """dp4's ranks 0, 2 and 3 time out in an all_reduce rank 1 never issued: the error names rank
    0 (the first to give up), and says that rank 1 never issued the collective the others wait
    in, with the group's sequence numbers as torch's flight recorder counted them."""
    s, victim = session, 1
    _fresh(s, "dp4")
    with pytest.raises(RankError) as caught:
        s.run(_skip_all_reduce_on, victim)
    err = caught.value
    assert "Timed out" in str(err) and victim not in (err.rank, *err.others), str(err)[:2000]
    found = err.mismatch  # the victim's last all_reduce is the one before the number its peers wait under
    assert (found.group, found.members, found.behind) == ("world", (0, 1, 2, 3), {victim: found.seq - 1}), err.where
    assert list(found.issued.values()) == [[0, 2, 3]] and [op for op, _, _ in found.issued] == ["all_reduce"]
    assert (f"first mismatch on group 'world' [0, 1, 2, 3] at collective #{found.seq}: rank(s) [{victim}] never issued it "
            f"(latest #{found.seq - 1}); rank(s) [0, 2, 3] issued all_reduce [[1]]") in str(err)
    assert s.run(_skip_all_reduce_on, -1) == [16.0] * 4  # the group re-formed: every rank joins both


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_fault_during_generate(session, fault):
    s, plan, victim = session, "pp2xdp2", 3
    _fresh(s, plan)
    before = s.generate(PROMPTS, max_new_tokens=8)
    assert s.run(_skip_all_reduce_on, -1) == [16.0] * 4  # this module's folder is now on every rank's sys.path
    s.inject(victim, fault, at_step=2)
    err, latency = _fails(lambda: s.generate(PROMPTS, max_new_tokens=8), fault, victim, s)
    _check_named(err, fault, victim)
    after, next_s = _next_call(s, lambda: s.generate(PROMPTS, max_new_tokens=8))
    _nothing_waits(s)
    assert s.model.restored.state == "snapshot" and s.model.restored.step == 2
    assert after == before
    # a rank that replaced a dead one imports this module's functions as its peers do
    assert s.run(_skip_all_reduce_on, -1) == [16.0] * 4
    MEASURED.append(dict(call="generate", plan=plan, fault=fault, where="step", named=err.ename, seconds=latency,
                         kept="snapshot", next_s=next_s))


def _requests() -> list[Request]:
    return [Request(id=str(i), prompt=p, arrival=0.05 * i, max_new_tokens=8) for i, p in enumerate(PROMPTS * 2)]


@pytest.mark.parametrize("fault", ["kill", "hang"])
@pytest.mark.parametrize("plan,engine", [("pp2xdp2", "ours"), ("dp4", "transformers")])
def test_fault_during_serve(session, plan, engine, fault):
    s, victim = session, 1
    _fresh(s, plan)
    before = s.serve(_requests(), engine=engine)
    assert before.engine == engine
    s.inject(victim, fault, at_step=2)
    err, latency = _fails(lambda: s.serve(_requests(), engine=engine), fault, victim, s)
    _check_named(err, fault, victim)
    after, next_s = _next_call(s, lambda: s.serve(_requests(), engine=engine))
    _nothing_waits(s)
    assert s.model.restored.state == "snapshot" and s.model.restored.step == 2
    assert [r.text for r in after.requests] == [r.text for r in before.requests]
    MEASURED.append(dict(call=f"serve ({engine})", plan=plan, fault=fault, where="step", named=err.ename,
                         seconds=latency, kept="snapshot", next_s=next_s))


def test_a_bad_fault_is_refused_before_any_rank_is_touched(session):
    s = session
    calls = s.ranks.pool.client.history[:]
    for bad, match in ((dict(rank=4, fault="kill"), r"rank\(4\)"), (dict(rank=0, fault="explode"), "explode"),
                       (dict(rank=0, fault="slow", seconds=-1.0), r"seconds\(-1.0\)"),
                       (dict(rank=0, fault="hang", where="optimizer"), "optimizer"),
                       (dict(rank=0, fault="raise", at_step=-1), r"at_step\(-1\)"),
                       (dict(rank=True, fault="raise"), r"rank\(True\)")):
        with pytest.raises(ValueError, match=match):
            s.inject(**bad)
    assert s.ranks.pool.client.history == calls


def _documented_rows() -> dict[tuple[str, str], list[str]]:
    """docs/faults.md's "What it survives" table: {(fault, during): its cells}."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "faults.md").read_text()
    section = page.split("## What it survives", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[(cells[0].strip("`"), cells[1])] = cells
    return rows


def _limit(cell: str) -> float:
    """'10 s' or 'timeout + 10 s' (the suite's timeout) in seconds."""
    return (TIMEOUT_S if "timeout" in cell else 0.0) + float(cell.split()[-2])


def test_docs_state_what_the_suite_measures():
    """docs/faults.md's "What it survives" table: for each fault during train, what the suite asserts
    is kept and the time the design aims at (LIMITS); every figure it quotes is within that
    time. This run's own latencies are figures (artifacts/faults.md), not assertions."""
    rows = _documented_rows()
    for fault in FAULTS:
        cells = rows.get((fault, "train"))
        assert cells, f"docs/faults.md's table has no row for {fault} during train"
        if fault in KEPT:
            word = "own shards" if KEPT[fault] == "kept" else "newest snapshot"
            assert word in cells[5], (fault, cells)
            assert _limit(cells[3]) == LIMITS[fault], (fault, cells[3])
            quoted = [float(x) for x in cells[4].rstrip(" s").split("-")]
            assert max(quoted) <= LIMITS[fault], (fault, cells[4])
    for call in ("generate", "serve"):
        for fault in ("kill", "hang"):
            assert (fault, call) in rows, f"docs/faults.md's table has no row for {fault} during {call}"


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f} s" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f} s"


def _write_figures() -> None:
    """Every case measured, then per fault and call the span over plans (docs/faults.md quotes it)."""
    if not MEASURED:
        return
    ARTIFACTS.mkdir(exist_ok=True)
    lines = ["| call | plan | fault | where | named as | s from fault to error | state after | next call s |",
             "|---|---|---|---|---|---|---|---|"]
    for m in MEASURED:
        lines.append(f"| {m['call']} | {m['plan']} | {m['fault']} | {m['where']} | {m['named']} | "
                     f"{m['seconds']:.2f} | {m['kept']} | {m['next_s']:.2f} |")
    groups: dict[tuple[str, str], list[dict]] = {}
    for m in MEASURED:
        groups.setdefault((m["fault"], m["call"].split()[0]), []).append(m)
    lines += ["", "| fault | during | plans | named as | s from fault to error | next call s |",
              "|---|---|---|---|---|---|"]
    for (fault, call), ms in groups.items():
        lines.append(f"| `{fault}` | {call} | {', '.join(dict.fromkeys(m['plan'] for m in ms))} | "
                     f"{', '.join(dict.fromkeys(m['named'] for m in ms))} | {_span([m['seconds'] for m in ms])} | "
                     f"{_span([m['next_s'] for m in ms])} |")
    (ARTIFACTS / "faults.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
