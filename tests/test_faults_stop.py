"""Stop in the middle of a pipeline schedule and of serving (tiny-llama, 4 live ranks, pp2xdp2):
`interrupt()` from another thread, and the panel's Stop button (which calls the same), end
every rank at the same step boundary; `verify()` then passes (nothing was left half-done)
and the next call works.

The oracle for "the same boundary": train: every rank reports the same StepRecords; serve:
the stages of each pipeline report the same DecodeSteps (numbered by its scheduler). The two
DP replicas agree on stopping in the same round of the scheduler's all_reduce, but a replica
with nothing to do idles through rounds without a step, so their step counts differ; a rank
that left at another round would leave its peers blocked in that all_reduce, and the call
would fail instead of returning. The run ended early: fewer steps than asked for, requests
left 'interrupted'. While serving, the ranks hold from the scheduler's fourth round until each
has the stop request (a gate), so the request cannot come after the last request finished on a
fast machine, or a slow client."""
from __future__ import annotations

import threading
import time

import pytest

from conftest import live_session, until
from interactive_parallel import Plan, Request
from interactive_parallel.plan.axes import MeshAxis, axis_groups

pytestmark = pytest.mark.faults

PLAN = Plan(pp=2, dp=2, batch_size=8, seq_len=32)
STEPS = 200
REQUESTS = 16
MAX_NEW = 48
WAIT_S = 120.0


@pytest.fixture(scope="module")
def session():
    with live_session(4, collective_timeout=5.0) as s:
        s.load_model("tiny-llama")
        s.apply(PLAN)
        yield s


def _same_boundary(steps_of: dict[int, list[int]]) -> list[int]:
    """Every rank's steps are the same; those steps."""
    first = next(iter(steps_of.values()))
    assert all(v == first for v in steps_of.values()), steps_of
    return first


def _after_stop(s) -> None:
    report = s.verify()
    assert report.ok, report
    assert len(s.train(steps=1)) == 4


@pytest.mark.parametrize("how", ["interrupt", "panel"])
def test_stop_during_a_pipeline_schedule(session, how):
    s = session
    start = len(s.history)
    if how == "interrupt":
        seen = []

        def on_step(recs):
            seen.append(recs[0].step)
            if len(seen) == 3:
                threading.Thread(target=s.interrupt).start()  # from elsewhere, as a click is

        out = list(s.train(steps=STEPS, on_step=on_step))
    else:
        from interactive_parallel.widgets import Panel

        p = Panel(s)
        job = p.train(STEPS)
        assert job is not None and until(lambda: p.run_section.progress.value >= 3, WAIT_S)
        assert not p.run_section.interrupt.disabled
        p.run_section.interrupt.click()
        assert p.wait(WAIT_S) and p.error_text == "", p.error_text
        assert "stopped after" in p.run_section.status.value, p.run_section.status.value
        out = s.history[start:]
    steps = _same_boundary({rank: sorted(r.step for r in out if r.rank == rank) for rank in range(4)})
    assert 3 <= len(steps) < STEPS, steps
    _after_stop(s)


def _requests() -> list[Request]:
    return [Request(id=str(i), prompt=f"{i}+{i}=", arrival=0.02 * i, max_new_tokens=MAX_NEW)
            for i in range(REQUESTS)]


def _hold_serve_rounds_from(first: int, wait_s: float) -> None:
    """Make every scheduler round from round `first` on wait, before the ranks' stop vote,
    until this rank has been asked to stop (a test fault, undone by `_heal_serve`). Every rank
    holds at the same round and outside any collective, once the tokens of the rounds before
    have gone to the client: the request cannot arrive after the last request has finished,
    however slow the client is to see the first token."""
    from interactive_parallel.runtime.inference import serve
    from interactive_parallel.runtime.rank import channel, state

    real = getattr(serve, "_real_agree", serve.agree)
    serve._real_agree = real
    rounds = iter(range(1 << 30))

    def held(par, elapsed, busy):
        if next(rounds) >= first and not channel.stop_requested():
            channel.flush()
            deadline = time.monotonic() + wait_s
            while not channel.stop_requested():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {state.get().rank}: the stop request never arrived")
                time.sleep(0.01)
        return real(par, elapsed, busy)

    serve.agree = held


def _heal_serve() -> None:
    from interactive_parallel.runtime.inference import serve

    serve.agree = getattr(serve, "_real_agree", serve.agree)


@pytest.mark.parametrize("how", ["interrupt", "panel"])
def test_stop_during_serve(session, how):
    s = session
    s.run(_hold_serve_rounds_from, 3, WAIT_S)  # by round 3 each replica has prefilled a request
    try:
        if how == "interrupt":
            tokens = []

            def on_token(t):
                tokens.append(t)
                if len(tokens) == 1:
                    threading.Thread(target=s.interrupt).start()

            result = s.serve(_requests(), engine="ours", on_token=on_token)
        else:
            from interactive_parallel.widgets import Panel

            p = Panel(s)
            job = p.serve(REQUESTS, engine="ours", max_tokens=MAX_NEW)
            assert job is not None and until(lambda: p.run_section.progress.value >= 1, WAIT_S)
            p.run_section.interrupt.click()
            assert p.wait(WAIT_S) and p.error_text == "", p.error_text
            result = s.served()
    finally:
        s.run(_heal_serve)
    assert result.engine == "ours"
    for pipeline in axis_groups(PLAN.mesh_shape, MeshAxis.PP):  # one replica's stages
        steps = _same_boundary({rank: sorted(d.step for d in result.steps if d.rank == rank) for rank in pipeline})
        assert steps == list(range(len(steps))), steps
    reasons = [r.finish_reason for r in result.requests]
    assert "interrupted" in reasons, reasons  # it ended early, at a boundary, not after the last request
    _after_stop(s)
