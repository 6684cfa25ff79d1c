"""The session keeps its training through failures, refuses what would not fit, and exports it
(4 live ranks, tiny-llama, batch 8x32, gloo).

- A rank SIGKILLed in the middle of train(steps=20) under fsdp4, dp2xtp2 and pp2xdp2: the
  RankError names that rank as a dead engine (found by its death, not by a collective's
  timeout, which is 30 s here); the next train()
  replaces the ranks and resumes from the newest snapshot (one every `snapshot_every`
  steps): its first step is the snapshot's, and its losses equal the uninterrupted
  single-process run's for those steps (LOSS_TOL = 1e-5, the parity tolerance), which
  they could not if weights or AdamW state had restarted. A rank killed after a re-plan with
  no snapshot since resumes from the snapshot of the plan before, resharded.
- A collective that fails with no rank dead (a rank raised): the group is re-formed and every
  rank keeps its own shards of weights and AdamW state, so the next steps' losses equal the
  single-process run's; switching debug mode (another re-formed group) keeps them too.
- A model predicted not to fit the ranks' memory is refused before anything is loaded,
  naming predicted and available bytes; the ranks keep their model and weights.
- The pool's controller SIGKILLed during train: the call fails naming it (ControllerDied, not
  a collective's timeout); the next call starts a new pool and resumes from the newest snapshot at parity.
- Stopping the session removes its scratch directory and the leash that guards it.
"""
from __future__ import annotations

import os
import re
import signal

import pytest
import torch

from conftest import live_session, single_process_losses, step_losses
from interactive_parallel import Plan
from interactive_parallel.cluster import RankError
from interactive_parallel.cluster.model_ops import MemoryRefused
from interactive_parallel.runtime import api

pytestmark = pytest.mark.session

LOSS_TOL = 1e-5
BATCH = dict(batch_size=8, seq_len=32)
KILL_AT = 7
VICTIM = 2


@pytest.fixture(scope="module")
def session():
    with live_session(4, collective_timeout=30) as s:  # stopped: nothing left, scratch directory included
        yield s


def killer(pid: int, at: int = KILL_AT):
    """An on_step that SIGKILLs `pid` once step `at` is complete, and the list of what it killed
    (empty until it has)."""
    killed: list[int] = []

    def on_step(records):
        if records[0].step == at and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    return on_step, killed


@pytest.fixture(scope="module")
def reference():
    """Per-step losses of 20 steps in one process (the parity tests tie every plan to it)."""
    return single_process_losses(20, **BATCH)



@pytest.mark.parametrize("fields,every", [(dict(fsdp=4), 1), (dict(dp=2, tp=2), 3), (dict(pp=2, dp=2), 3)],
                         ids=["fsdp4", "dp2xtp2", "pp2xdp2"])
def test_killed_rank_is_named_and_training_resumes_from_the_snapshot(session, reference, fields, every):
    s = session
    s.load_model("tiny-llama")
    s.apply(Plan(**fields, **BATCH))
    pid = s.ranks_info[VICTIM].pid
    on_step, killed = killer(pid)
    with pytest.raises(RankError) as exc:
        s.train(steps=20, snapshot_every=every, on_step=on_step)
    assert killed and exc.value.rank == VICTIM, str(exc.value)[:500]
    assert exc.value.ename == "EngineDied", str(exc.value)[:500]
    with pytest.warns(UserWarning, match=rf"rank\(s\) \[{VICTIM}\] died"):
        resumed = s.train(steps=4, snapshot_every=every)
    assert pid not in [r.pid for r in s.ranks_info]
    first = min(r.step for r in resumed)
    assert s.model.restored.state == "snapshot" and s.model.restored.step == first
    assert first % every == 0 and KILL_AT + 1 - every < first <= KILL_AT + 4, first
    for step, loss in step_losses(resumed).items():
        assert abs(loss - reference[step]) <= LOSS_TOL, (step, loss, reference[step])


def test_a_killed_controller_is_named_at_once_and_the_next_call_resumes_in_a_new_pool(session, reference):
    """The local ipyparallel controller is the session's own child: killed during a train call,
    the call fails naming it (ControllerDied, not a collective's timeout blamed on a rank),
    and the next call starts a pool of the same size and resumes from the newest snapshot."""
    s = session
    s.load_model("tiny-llama")
    s.apply(Plan(dp=4, **BATCH))
    controller = s.ranks.pool.controller_pid()
    engines = {r.pid for r in s.ranks_info}
    on_step, killed = killer(controller)
    with pytest.raises(RankError) as exc:
        s.train(steps=20, snapshot_every=3, on_step=on_step)
    assert exc.value.ename == "ControllerDied" and f"pid {controller}" in str(exc.value), str(exc.value)[:500]
    assert killed
    with pytest.warns(UserWarning, match="controller died"):
        resumed = s.train(steps=2, snapshot_every=0)
    assert s.ranks.pool.controller_pid() != controller and not engines & {r.pid for r in s.ranks_info}
    first = min(r.step for r in resumed)
    assert s.model.restored.state == "snapshot" and s.model.restored.step == first and first % 3 == 0
    for step, loss in step_losses(resumed).items():
        assert abs(loss - reference[step]) <= LOSS_TOL, (step, loss, reference[step])


def test_a_rank_dead_after_a_replan_resumes_from_the_snapshot_of_the_plan_before(session, reference):
    """Each rank's snapshot holds its own shards of the layout that wrote it: after a re-plan
    with no snapshot since, recovery lays the old layout out again, fills it and reshards it
    into the current one (as a re-plan does), so the steps that follow keep parity."""
    s = session
    s.load_model("tiny-llama")
    s.apply(Plan(dp=4, **BATCH))
    s.train(steps=3, snapshot_every=3)  # the snapshot: step 3, under dp4
    s.train(steps=2, snapshot_every=0)
    s.apply(Plan(dp=2, tp=2, **BATCH))
    pid = s.ranks_info[VICTIM].pid

    def on_step(records):  # killed inside a call: named by it, whenever the pool notices
        os.kill(pid, signal.SIGKILL)

    with pytest.raises(RankError) as exc:
        s.train(steps=20, snapshot_every=0, on_step=on_step)
    assert exc.value.rank == VICTIM, str(exc.value)[:500]
    with pytest.warns(UserWarning, match=rf"rank\(s\) \[{VICTIM}\] died"):
        resumed = s.train(steps=2, snapshot_every=0)
    assert s.model.restored.state == "snapshot" and s.model.restored.step == 3
    assert s.plan.describe() == "dp2xtp2" and {r.plan for r in resumed} == {"dp2xtp2"}
    losses = step_losses(resumed)
    assert sorted(losses) == [3, 4]
    for step, loss in losses.items():
        assert abs(loss - reference[step]) <= LOSS_TOL, (step, loss, reference[step])


def test_a_model_too_large_is_refused_before_loading(session):
    s = session
    s.load_model("tiny-llama")
    s.apply(Plan(dp=4, **BATCH))
    s.train(steps=1, snapshot_every=0)
    before = s.run(api.full_state_dict)[0]
    llama_8b = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    max_position_embeddings=8192)
    with pytest.raises(MemoryRefused) as exc:
        s.load_model(llama_8b)
    text = str(exc.value)
    assert re.search(r"predicted to need [\d.,]+ GiB \([\d,]+ bytes\)", text), text
    assert re.search(r"the host has [\d.,]+ GiB \([\d,]+ bytes\) available", text), text
    assert s.spec.name == "tiny-llama"
    after = s.run(api.full_state_dict)[0]
    assert set(after) == set(before) and all(torch.equal(after[k], v) for k, v in before.items())


def _fail_on_rank_1() -> float:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("rank one fails before the collective")
    t = torch.ones(1)
    dist.all_reduce(t)  # peers wait here until the collective timeout
    return t.item()


def test_a_failed_collective_keeps_weights_optimizer_and_step(reference):
    """No rank dies: the group is re-formed and every rank keeps its own shards (no snapshot)."""
    with live_session(4, collective_timeout=5, snapshot_every=0) as s:
        s.load_model("tiny-llama")
        s.apply(Plan(fsdp=2, tp=2, **BATCH))
        s.train(steps=3)
        with pytest.raises(RankError):
            s.run(_fail_on_rank_1)
        resumed = s.train(steps=3)
        assert s.model.restored.state == "kept" and s.model.restored.step == 3
        losses = step_losses(resumed)
        assert sorted(losses) == [3, 4, 5]
        assert all(abs(loss - reference[step]) <= LOSS_TOL for step, loss in losses.items()), losses
        before = s.run(api.full_state_dict)[0]
        s.set_debug(True)  # another re-formed group: the same shards kept
        after = s.run(api.full_state_dict)[0]
        assert s.model.restored.state == "kept"
        assert all(torch.equal(after[k], v) for k, v in before.items())
        s.set_debug(False)
