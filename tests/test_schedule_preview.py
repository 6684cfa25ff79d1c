"""The schedule preview against torch: each schedule's order per rank is torch's own, the simulation
keeps every dependency, and a bad plan is refused before torch is imported on the client."""
from __future__ import annotations

import subprocess
import sys

import pytest

from interactive_parallel.plan import Plan, PlanError
from interactive_parallel.records import from_dict

pytestmark = pytest.mark.rank1  # torch in this process, no process group

PLANS = [Plan(pp=2, pp_schedule=s, microbatches=m, batch_size=8) for s, m in
         [("gpipe", 4), ("1f1b", 4), ("interleaved-1f1b", 4), ("interleaved-zb", 4), ("zbv", 4), ("dualpipev", 4)]]
PLANS += [Plan(pp=4, pp_schedule="1f1b", microbatches=8, batch_size=8),
          Plan(pp=4, pp_schedule="interleaved-zb", microbatches=8, batch_size=8),
          Plan(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=3, microbatches=4, batch_size=8)]


def _flat(actions) -> list[str]:
    out = []
    for a in actions:  # DualPipeV's overlapped pair as its two halves, as the preview simulates it
        out += [str(s) for s in a.sub_actions] if a.sub_actions else [str(a)]
    return out


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.pp_schedule}-pp{p.pp}-v{p.stages_per_rank}")
def test_order_per_rank_is_torchs(plan):
    from interactive_parallel.runtime.client.schedule_preview import preview_schedule, torch_order

    preview, torch = preview_schedule(plan), torch_order(plan)
    assert sorted(torch) == list(range(plan.pp)) == sorted(preview.idle)
    for rank, acts in torch.items():
        theirs = _flat(acts)
        if plan.pp_schedule == "1f1b" and rank == plan.pp - 1:
            # torch 2.13 numbers the last rank's forwards 1..m (its runtime runs 0..m-1): if this
            # fails, torch is fixed and the preview's renumbering (schedule_preview.py) can go.
            assert [a for a in theirs if "F" in a] == [f"{rank}F{m}" for m in range(1, plan.n_microbatches + 1)]
            assert preview.notes and f"rank {rank}" in preview.notes[0]
            theirs = [a.replace(f"F{m + 1}", f"F{m}") if "F" in a else a for a in theirs
                      for m in [int(a.split("F")[1]) - 1 if "F" in a else 0]]
        assert preview.order(rank) == theirs
    stages = {a.stage for a in preview.actions if a.rank == 0}
    assert stages == set(plan.stage_ids(0))  # the V and the loop hold what the plan says
    per_mb = plan.n_stages * (3 if plan.zero_bubble and plan.pp_schedule != "dualpipev" else 2)
    if plan.pp_schedule != "dualpipev":  # DualPipeV mixes full (B) and split (I + W) backwards
        assert sum(a.is_compute for a in preview.actions) == per_mb * plan.n_microbatches
    assert from_dict(preview.to_dict()).actions == preview.actions


def test_simulation_keeps_the_dependencies_and_its_idle():
    from interactive_parallel.runtime.client.schedule_preview import preview_schedule

    plan = Plan(pp=2, pp_schedule="zbv", microbatches=4, batch_size=8)
    p = preview_schedule(plan)
    slot = {(a.stage, a.action, a.microbatch): a.slot for a in p.actions}
    for (stage, kind, mb), t in slot.items():
        if kind == "F" and stage > 0:
            assert t > slot[(stage - 1, "F", mb)]
        if kind == "RECV_F":
            assert t >= slot[(stage - 1, "SEND_F", mb)]
        if kind == "W":
            assert t > slot[(stage, "I", mb)]
    for rank, idle in p.idle.items():
        busy = sum(a.is_compute for a in p.actions if a.rank == rank)
        comm = sum(not a.is_compute for a in p.actions if a.rank == rank)
        assert idle == pytest.approx(1 - busy / (p.slots - comm))
    assert p.slots == 1 + max(a.slot for a in p.actions)
    assert any(a.action == "SEND_F" for a in p.actions) and any(a.action == "RECV_B" for a in p.actions)
    dual = preview_schedule(plan.replace(pp_schedule="dualpipev"))
    assert any(a.overlapped for a in dual.actions) and "OVERLAP_F_B" in dual.notes[0]


def test_bad_plan_refused_before_torch_loads():
    code = ("import sys\n"
            "from interactive_parallel.plan import Plan, PlanError\n"
            "from interactive_parallel.cluster.schedules import preview_schedule\n"
            "for plan in (Plan(pp=2, pp_schedule='dualpipev', microbatches=2, batch_size=8), Plan(dp=2)):\n"
            "    try:\n"
            "        preview_schedule(plan, None)\n"
            "    except PlanError as e:\n"
            "        print(e.problems)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert "'dualpipev' needs microbatches(2)" in out[0]
    assert "pp(1)" in out[1] and out[2] == "False"


def test_session_preview_defaults_to_the_applied_plan():
    from interactive_parallel.cluster.errors import SessionError
    from interactive_parallel.cluster.schedules import preview_schedule

    with pytest.raises(SessionError, match="no plan to preview"):
        preview_schedule(None, None)
    with pytest.raises(PlanError, match="microbatches"):
        preview_schedule(Plan(pp=2, pp_schedule="1f1b", microbatches=1, batch_size=8), None)
