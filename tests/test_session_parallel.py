"""Session-level parallel workflows on 4 live ranks: hot re-plan, verify, checkpoints across
plans, generation under TP/PP, export. (Numerical parity per plan lives in test_parallel_*.)"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from interactive_parallel import Plan
from interactive_parallel.cluster import SessionError
from interactive_parallel.records import VerifyReport, from_dict
from interactive_parallel.runtime import api

pytestmark = pytest.mark.session


def _weights(s):
    return s.run(api.full_state_dict)[0]


def _same(a, b, tol=1e-6):
    return set(a) == set(b) and max((a[k] - b[k]).abs().max().item() for k in a) <= tol


def test_hot_replan_keeps_weights_and_generation(session4):
    s = session4
    s.load_model("tiny-llama")
    s.apply(Plan(dp=2, tp=2, batch_size=8, seq_len=32, lr=3e-3))
    s.train(steps=3)
    before, text = _weights(s), s.generate(["12+35=", "3+4="], max_new_tokens=4)
    for plan in (Plan(pp=2, tp=2, microbatches=2, batch_size=8, seq_len=32, lr=3e-3),
                 Plan(fsdp=2, cp=2, batch_size=8, seq_len=32, lr=3e-3),
                 Plan(dp=4, batch_size=8, seq_len=32, lr=3e-3)):
        s.apply(plan)
        assert _same(_weights(s), before), plan.describe()
        if plan.cp == 1:
            assert s.generate(["12+35=", "3+4="], max_new_tokens=4) == text, plan.describe()


def test_verify_report_under_a_2d_plan(session4):
    s = session4
    s.load_model("tiny-llama")
    s.apply(Plan(dp=2, tp=2, batch_size=8, seq_len=32))
    s.train(steps=1)
    report = s.verify()
    assert isinstance(report, VerifyReport) and report.ok and report.dloss < report.tolerance["loss"]
    names = {p.name for p in report.params}
    assert "model.layers.0.self_attn.q_proj.weight" in names and len(names) > 10
    assert "MISMATCH" not in str(report) and "q_proj" in str(report)
    assert from_dict(report.to_dict()) == report  # nested ParamDiff records come back as records


def test_gradient_clipping_records_the_norm_names_its_all_reduce_and_verifies(session4):
    """train(max_grad_norm=...) clips on the whole model's norm: every rank records the same
    norm, the ledger names the norm's all-reduce (tp's shards; dp's replicas hold the same), and
    verify() compares with one process clipped the same way."""
    s = session4
    s.load_model("tiny-llama")
    s.apply(Plan(dp=2, tp=2, batch_size=8, seq_len=32))
    assert all(r.grad_norm is None for r in s.train(steps=1))  # 0: no clipping, no norm
    recs = s.train(steps=2, max_grad_norm=1.0)
    assert s.plan.max_grad_norm == 1.0 and s.plan.dp == 2 and s.plan.tp == 2  # a knob: the layout is kept
    for step in {r.step for r in recs}:
        norms = [r.grad_norm for r in recs if r.step == step]
        assert len(norms) == 4 and max(norms) == pytest.approx(min(norms), rel=1e-6) and min(norms) > 1.0, norms
    clip = [c for r in recs for c in r.comms if c.module == "clip_grad_norm"]
    assert clip and {(c.op, c.axis, c.phase) for c in clip} == {("all_reduce", "tp", "optimizer")}, clip
    report = s.verify()
    assert report.ok, str(report)


def test_checkpoint_saved_under_one_plan_loads_under_another(session4, tmp_path):
    s = session4
    s.load_model("tiny-llama")
    s.apply(Plan(tp=2, dp=2, batch_size=8, seq_len=32))
    s.train(steps=2)
    saved = _weights(s)
    path = s.save(str(tmp_path / "ckpt"))
    s.train(steps=2)  # move away from the saved weights
    assert not _same(_weights(s), saved)
    s.apply(Plan(pp=2, dp=2, batch_size=8, seq_len=32))
    s.load(path)
    assert _same(_weights(s), saved)


def test_checkpoint_of_another_model_is_refused_before_ranks(session4, tmp_path, monkeypatch):
    s = session4
    s.load_model("tiny-llama")
    s.apply(Plan(dp=4))
    path = s.save(str(tmp_path / "llama"))
    s.load_model("tiny-gpt2")
    s.apply(Plan(dp=4))
    monkeypatch.setattr(s.ranks.caller, "submit", lambda *a, **k: pytest.fail("a rank was touched"))
    with pytest.raises(SessionError, match="tiny-llama") as exc:
        s.load(path)
    assert "transformer.wte.weight: missing from the checkpoint (model has [128, 64])" in str(exc.value)
    assert "model.embed_tokens.weight: in the checkpoint ([128, 64]), not in the model" in str(exc.value)


def test_export_script_runs_under_torchrun(session4, tmp_path):
    s = session4
    s.load_model("tiny-llama")
    s.apply(Plan(dp=2, tp=2, batch_size=8, seq_len=32))
    s.train(steps=1)
    script = s.export_script(str(tmp_path / "train_tp2_dp2.py"), steps=1)
    assert "torchrun --nproc_per_node 4" in Path(script).read_text()
    assert (tmp_path / "train_tp2_dp2_state" / ".metadata").is_file()  # the state the script resumes
    nxt = s.train(steps=1)  # step 1, from the state the script resumes
    session_loss = sum(r.loss for r in nxt) / len(nxt)
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "4", script],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = {int(a): float(b) for a, b in re.findall(r"step (\d+) loss ([0-9.]+)", out.stdout)}
    assert list(losses) == [1] and abs(losses[1] - session_loss) < 1e-4, out.stdout


def _gpt2_family(**changes):
    """On a rank, as notebook 06's set_tp_style: GPT-2's family facts with `changes`; the old ones returned."""
    import dataclasses

    from interactive_parallel.plan import models

    before = models.FAMILIES["gpt2"]
    models.FAMILIES["gpt2"] = dataclasses.replace(before, **changes)
    return before


def _set_gpt2_family(family) -> None:
    from interactive_parallel.plan import models

    models.FAMILIES["gpt2"] = family


def test_the_lint_names_notebook_06s_broken_layouts_before_verify(session4):
    """Notebook 06's broken layouts made on the ranks as the notebook makes them: apply warns,
    check_layout names the parameter and the axis, and verify() then shows the numbers off; the
    correct layout of the same plan lints clean of anything wrong."""
    from interactive_parallel.cluster.lint_notes import LayoutWarning
    from interactive_parallel.plan import FAMILIES

    s, fam = session4, FAMILIES["gpt2"]
    broken = [(dict(tp_plan={**fam.tp_plan, "transformer.h.*.attn.c_attn": "colwise"}),
               Plan(dp=2, tp=2, batch_size=8, seq_len=32), "transformer.h.0.attn.c_attn.weight", "split_fused"),
              (dict(norm_paths=("ln_1",)), Plan(dp=2, tp=2, sequence_parallel=True, batch_size=8, seq_len=32),
               "transformer.h.0.ln_2.weight", "grad_not_reduced")]
    try:
        for changes, plan, param, fault in broken:
            s.run(_gpt2_family, **changes)
            s.load_model("tiny-gpt2")
            with pytest.warns(LayoutWarning, match=re.escape(param)):
                s.apply(plan)
            found = s.check_layout()
            assert any((f.param, f.axis, f.fault, f.severity, f.ranks) == (param, "tp", fault, "wrong", [0, 1, 2, 3])
                       for f in found), found
            report = s.verify()
            diffs = {p.name: p.max_abs_diff for p in report.params}
            assert not report.ok and diffs[param] > report.tolerance["grad"], report
            s.run(_set_gpt2_family, fam)
            s.load_model("tiny-gpt2")
            s.apply(plan)
            assert [f for f in s.check_layout() if f.severity == "wrong"] == [] and s.verify().ok
    finally:
        s.run(_set_gpt2_family, fam)
