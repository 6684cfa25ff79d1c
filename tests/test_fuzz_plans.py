"""Bad input drawn at random: 200 plans and training settings against one live 4-rank session.

Each draw is a Plan (every field: a sound value, a degree 0..9, a negative number, a wrong
type or a huge size) applied with `apply`, then one `train` step with drawn knobs. Each of
the two calls is either accepted and runs (apply lays the model out; train returns one step's
record from every rank) or refused with PlanError before any rank is touched: the refusal
sends nothing to the ranks but the memory check's read-only question (api.host_memory), and
the session keeps the plan it had. Half the draws start from a plan that runs and change a
few fields, so that both sides are exercised; the seed is fixed, so a failure reproduces.
Over the whole run no engine restarts (the ranks' pids stay the same).
"""
from __future__ import annotations

import math
import random

import pytest

from conftest import live_session
from interactive_parallel import Plan, PlanError
from interactive_parallel.runtime import api

pytestmark = pytest.mark.faults

DRAWS = 200
SEED = 20261130
HUGE = 10**12
SOUND = [dict(dp=4), dict(fsdp=4), dict(dp=2, tp=2), dict(pp=2, dp=2), dict(dp=2, cp=2), dict(tp=4),
         dict(fsdp=2, tp=2), dict(pp=4, microbatches=4), dict(pp=2, fsdp=2, pp_schedule="gpipe")]
"""Layouts tiny-llama runs on 4 ranks; the draws mutate them."""
BAD = [0, -1, -7, HUGE, 2**64, 2.0, "2", None, True, [2]]
"""Values any numeric field may draw besides its own sound ones."""
FIELDS = {
    "device": ["cpu", "cpu", "cuda", "tpu", 0, None],
    **{axis: list(range(10)) for axis in ("dp", "fsdp", "tp", "pp", "cp")},
    "pp_schedule": ["1f1b", "gpipe", "interleaved-1f1b", "zb", 1],
    "microbatches": [0, 1, 2, 4, 8],
    "virtual_stages": [1, 2, 3],
    "sequence_parallel": [False, True, 1, "yes"],
    "recompute": ["none", "selective", "full", "all", None],
    "batch_size": [4, 8, 16, 3, 12],
    "seq_len": [16, 32, 48, 256, 257, 1],
    "grad_accum": [1, 2, 4, 3],
    "precision": ["fp32", "bf16", "fp16", "fp8", 32],
    "lr": [1e-3, 1e-4, 0.5, 0.0, -1e-3, math.inf, math.nan, "1e-3", 1],
    "max_grad_norm": [0.0, 1.0, 0.5, 1e-6, -1.0, math.inf, math.nan],
    "seed": [0, 1, 7, -1, 2**63, 2**63 - 1, 1.5],
}
KNOBS = ("batch_size", "seq_len", "grad_accum", "lr", "precision", "max_grad_norm")


def _value(rng: random.Random, name: str):
    bad = rng.random() < 0.3 and name not in ("device", "pp_schedule", "recompute", "precision")
    return rng.choice(BAD if bad else FIELDS[name])


def _draw_plan(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        fields = dict(rng.choice(SOUND), batch_size=8, seq_len=32)
        for name in rng.sample(sorted(FIELDS), rng.choice([0, 0, 1, 2])):
            fields[name] = _value(rng, name)
        return fields
    return {name: _value(rng, name) for name in FIELDS if rng.random() < 0.6}


def _draw_knobs(rng: random.Random) -> dict:
    if rng.random() < 0.4:
        return {}
    return {name: _value(rng, name) for name in rng.sample(KNOBS, rng.choice([1, 1, 2]))}


class _Spy:
    """Every function sent to the ranks, by name; the memory check's question is only a read."""

    def __init__(self, session, monkeypatch):
        self.sent: list[str] = []
        caller = session.ranks.caller
        real = caller.submit

        def submit(fn, *a, **k):
            self.sent.append(getattr(fn, "__name__", repr(fn)))
            return real(fn, *a, **k)

        monkeypatch.setattr(caller, "submit", submit)

    def touched(self) -> list[str]:
        return [name for name in self.sent if name != api.host_memory.__name__]


def _attempt(spy: _Spy, session, call, what: str, tally: dict) -> bool:
    """True if `call` ran; False if it was refused with PlanError without touching a rank
    or changing the session's plan; anything else fails the test, naming the draw."""
    spy.sent.clear()
    before = session.plan
    try:
        call()
    except PlanError as exc:
        assert not spy.touched(), f"{what}: refused ({exc.problems}) after sending {spy.touched()} to the ranks"
        assert session.plan == before, f"{what}: refused but the plan changed"
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
        tally["refused"] += 1
        return False
    except Exception as exc:  # a refusal of another type, or a crash on the ranks
        raise AssertionError(f"{what}: raised {type(exc).__name__} instead of running or PlanError: {exc}") from exc
    tally["ran"] += 1
    return True


def test_random_plans_run_or_are_refused_untouched(monkeypatch):
    rng = random.Random(SEED)
    tally = {"ran": 0, "refused": 0}
    with live_session(4, snapshot_every=0) as s:
        s.load_model("tiny-llama")
        s.apply(Plan(dp=4, batch_size=8, seq_len=32))
        pids = [r.pid for r in s.ranks_info]
        spy = _Spy(s, monkeypatch)
        for i in range(DRAWS):
            fields, knobs = _draw_plan(rng), _draw_knobs(rng)
            _attempt(spy, s, lambda: s.apply(Plan(**fields)), f"draw {i}: apply(Plan(**{fields}))", tally)
            step = len({r.step for r in s.history})

            def one_step():
                records = s.train(1, **knobs)
                assert len(records) == 4 and len({r.step for r in records}) == 1, records

            if _attempt(spy, s, one_step, f"draw {i}: train(1, **{knobs}) under {s.plan}", tally):
                assert len({r.step for r in s.history}) == step + 1
        assert [r.pid for r in s.ranks_info] == pids, "an engine was restarted during the draws"
        monkeypatch.undo()
        # the next call works (from the seed again: large drawn learning rates may have left NaN weights)
        s.load_model("tiny-llama")
        s.apply(Plan(dp=4, batch_size=8, seq_len=32))
        assert all(math.isfinite(r.loss) for r in s.train(1))
    # both sides were exercised by the draws, not only one
    assert tally["ran"] >= DRAWS // 5 and tally["refused"] >= 3 * DRAWS // 5, tally  # of 2 * DRAWS calls
