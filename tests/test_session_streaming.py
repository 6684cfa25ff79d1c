"""Long calls run on the ranks and stream back (tiny-llama, 4 live ranks, gloo): one remote call
for `train(steps=N)`, each step's records arriving while the ranks keep going, Stop ending every
rank at the same step boundary, a rank failing mid-run, and generation streaming its tokens."""
from __future__ import annotations

import threading
import time

import pytest

from interactive_parallel import Plan
from interactive_parallel.cluster import RankError
from interactive_parallel.records import MemoryRecord, StepRecord, TokenRecord

pytestmark = pytest.mark.session
PLAN = Plan(dp=2, tp=2, batch_size=8, seq_len=32)


@pytest.fixture
def laid_out(session4):
    session4.load_model("tiny-llama")
    session4.apply(PLAN)
    return session4


def _wrap_train_step(wrap) -> None:
    """On a rank: runtime.training.train.train_step replaced by `wrap(real)` (a test fault, undone by `_heal`)."""
    import interactive_parallel.runtime.training.train as train

    real = getattr(train, "_real_train_step", train.train_step)
    train._real_train_step = real
    train.train_step = wrap(real)


def _heal() -> None:
    import interactive_parallel.runtime.training.train as train

    train.train_step = getattr(train, "_real_train_step", train.train_step)


def _step_now(s) -> int:
    """The optimizer step the ranks will number next."""
    return s.run(lambda: __import__("interactive_parallel.runtime.rank.state", fromlist=["get"]).get().step)[0]


def _hold_steps_after(step: int, wait_s: float, gate: str | None = None) -> None:
    """Make every optimizer step after `step` wait (a test fault, undone by `_heal`):
    - with `gate`, until that file exists: the client writes it when it has seen step `step`,
      so a run whose records did not stream would stop here and raise instead of finishing;
    - without, until this rank has been asked to stop (its own view,
      runtime.rank.channel.stop_requested), once what it holds for the client has gone: the ranks
      cannot run ahead of the request, however slow the client is to see the steps and ask."""
    import os

    from interactive_parallel.runtime.rank import channel, state

    def released() -> bool:
        return os.path.exists(gate) if gate else channel.stop_requested()

    def wrap(real):
        def held(par, optimizer, index, **kw):
            deadline = time.monotonic() + wait_s
            if index > step and not gate:
                channel.flush()  # records held back for the next publish go now: the client sees them
            while index > step and not released():
                if time.monotonic() > deadline:
                    waited = f"step {step} never reached the client" if gate else "the stop request never arrived"
                    raise RuntimeError(f"rank {state.get().rank}: {waited}")
                time.sleep(0.01)
            return real(par, optimizer, index, **kw)
        return held

    _wrap_train_step(wrap)


def test_train_is_one_remote_call_and_steps_arrive_while_it_runs(laid_out, monkeypatch, tmp_path):
    s = laid_out
    submits = []
    real = s.ranks.caller.submit
    first = _step_now(s)
    gate = tmp_path / "client-saw-the-first-step"
    s.run(_hold_steps_after, first, 30.0, str(gate))
    monkeypatch.setattr(s.ranks.caller, "submit", lambda fn, *a, **k: submits.append(fn.__name__) or real(fn, *a, **k))
    arrivals, where = [], []

    def on_step(recs):
        if not arrivals:  # the ranks hold their second step until the gate: ask where they are
            where.append(s.stacks())
        arrivals.append(recs)
        gate.touch()  # the ranks' second step starts only now: what ran before it has streamed

    try:
        out = s.train(steps=6, on_step=on_step)
    finally:
        monkeypatch.undo()
        s.run(_heal)
    assert submits == ["train"], submits  # one call to the ranks for all six steps
    assert [recs[0].step for recs in arrivals] == sorted({r.step for r in out}) == list(range(first, first + 6))
    assert all(sorted(r.rank for r in recs) == [0, 1, 2, 3] for recs in arrivals)
    head = arrivals[0][0]
    assert isinstance(head, StepRecord) and isinstance(head.memory, MemoryRecord) and head.comms
    assert [(r.rank, r.step, r.loss) for r in s.history[-len(out):]] == [(r.rank, r.step, r.loss) for r in out]
    # where each rank was while the train ran: inside the train loop, held in the test's gate (an answer from
    # each rank's control thread, the main thread being busy with the call; no call submitted for it)
    stacks = where[0]
    assert [(x.rank, x.main, x.state) for x in stacks] == [(r, True, "running") for r in range(4)], str(stacks)
    for x in stacks:
        calls = [(f.file.rsplit("/", 1)[-1], f.function, f.own) for f in x.frames]
        assert ("loop.py", "train", True) in calls, calls
        assert x.where.startswith("test_session_streaming.py:") and x.where.endswith(" in held"), x.where
    # the comm ledger's records carry their group's sequence number as torch's flight recorder counts it: the
    # last step's collectives are found in s.collectives() under the same rank, group and number
    recorded = {(c.rank, tuple(c.ranks), c.seq): c.op for c in s.collectives(last=400) if not c.p2p}
    ledger = [c for r in out if r.step == out[-1].step for c in r.comms if c.op not in ("send", "recv")]
    missing = [(c.rank, c.op, c.group, c.seq) for c in ledger if (c.rank, tuple(c.group), c.seq) not in recorded]
    assert ledger and not missing, (missing[:10], sorted(recorded)[-10:])
    assert all(recorded[c.rank, tuple(c.group), c.seq] == c.op for c in ledger)  # tp's and dp's all-reduces


@pytest.mark.parametrize("plan", [PLAN, Plan(dp=4, batch_size=8, seq_len=32)], ids=["dp2xtp2", "dp4"])
def test_interrupt_stops_every_rank_at_the_same_boundary_within_one_step(session4, plan):
    """Under dp2xtp2 the ranks vote in a collective of its own; under pure DDP the vote rides
    in the last gradient bucket (runtime.rank.channel.ddp_vote_hook). The client asks to stop once it
    has seen three steps; the ranks hold the fourth until each has the request (a gate, so the
    count does not depend on how fast the machine is): the vote cast during that fourth step
    stops every rank at its end, one step after the request, never later."""
    s = session4
    s.load_model("tiny-llama")
    s.apply(plan)
    first = _step_now(s)
    s.run(_hold_steps_after, first + 2, 60.0)
    seen = []

    def on_step(recs):
        seen.append(recs[0].step)
        if len(seen) == 3:
            threading.Thread(target=s.interrupt).start()  # as the panel's Stop does, from elsewhere

    try:
        out = s.train(steps=200, on_step=on_step)
    finally:
        s.run(_heal)
    steps = sorted({r.step for r in out})
    per_rank = {rank: sorted(r.step for r in out if r.rank == rank) for rank in range(4)}
    assert all(v == steps for v in per_rank.values()), per_rank  # the same boundary on every rank
    assert seen[:3] == list(range(first, first + 3)), seen
    assert steps == list(range(first, first + 4)), (steps, seen)  # the step after the request, no more
    assert s.verify().ok  # nothing left half-done
    assert len(s.train(steps=1)) == 4


def _fail_at_step(rank: int, step: int) -> None:
    """Make `rank` raise in the optimizer step numbered `step` (a test fault)."""
    from interactive_parallel.runtime.rank import state

    def wrap(real):
        def faulty(par, optimizer, index, **kw):
            if state.get().rank == rank and index == step:
                raise RuntimeError(f"injected failure at step {step}")
            return real(par, optimizer, index, **kw)
        return faulty

    _wrap_train_step(wrap)


def test_rank_failing_mid_run_is_named_and_steps_done_are_kept():
    from interactive_parallel import Session

    with Session(ranks=2, collective_timeout=5) as s:
        s.load_model("tiny-llama")
        s.apply(Plan(dp=2, batch_size=4, seq_len=16))
        start = len(s.history)
        first = _step_now(s)
        s.run(_fail_at_step, 1, first + 3)
        with pytest.raises(RankError) as exc:
            s.train(steps=10)
        assert exc.value.rank == 1 and "injected failure at step" in str(exc.value)
        kept = s.history[start:]
        assert sorted({r.step for r in kept}) == [first, first + 1, first + 2]  # the three done before it
        s.run(_heal)
        assert len(s.train(steps=1)) == 2  # the group is re-formed; training goes on


def test_generation_streams_tokens(laid_out):
    s = laid_out
    tokens: list[TokenRecord] = []
    out = s.generate(["12+35=", "7+8="], max_new_tokens=5, on_token=tokens.append)
    assert all(isinstance(t, TokenRecord) for t in tokens)
    for i, text in enumerate(out):
        mine = sorted((t for t in tokens if t.prompt == i), key=lambda t: t.position)
        assert [t.position for t in mine] == list(range(5))  # one record per decoding step
        assert "".join(t.text for t in mine) == text and mine[-1].done
