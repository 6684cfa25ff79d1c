"""Plan(compile=True): each decoder block compiled in place (runtime/parallel/compile.py).

Pure: refused where it cannot run, off by default, the estimate unchanged, the panel's checkbox
and note, the exported script's plan. One rank: names kept, decoding and the dry run run the
blocks eagerly (nothing is compiled), the session's cache directory taken. Multirank (slow:
inductor compiles on 2 cores): tp2 (the vocabulary ends split), tp2 with sequence and loss
parallel, tp2 with sequence parallel and full recomputation, pp2, cp2 and dp2 with full
recomputation compiled, at parity with one eager process. Session (slow): a live session compiles into its scratch
directory, which goes at stop.

Tolerances: the eager parity tolerances hold (loss 1e-5, gradients 1e-5, weights 1e-4 after
AdamW steps). Inductor fuses the fp32 pointwise ops and reorders some reductions (the norms'
means, the softmax), which moves results by rounding only: measured on tiny-llama, 2 steps,
loss ~5e-7, gradients ~4e-7, weights ~7e-6, the same size as eager layouts' own differences.
"""
from __future__ import annotations

import html
import os
import re

import pytest

import parity_workers as W
from mp_harness import run_ranks
from interactive_parallel.plan import PRESETS, Plan, validate
from interactive_parallel.plan.validate import _compile_problems

LOSS_TOL, GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-5, 1e-4
STEPS = 2
LLAMA = "tiny-llama"
CONFIGS_2 = [
    ("tp2", LLAMA, dict(tp=2, compile=True)),  # the vocabulary ends split, as eager tp splits them
    ("tp2-sp-lp", LLAMA, dict(tp=2, sequence_parallel=True, loss_parallel=True, compile=True)),  # the cuts traced whole
    ("tp2-sp-recompute", LLAMA, dict(tp=2, sequence_parallel=True, recompute="full", compile=True)),
    ("pp2", LLAMA, dict(pp=2, compile=True)),
    ("cp2", LLAMA, dict(cp=2, compile=True)),  # compiled in pieces around its collectives
    # in pieces around checkpoint's hooks; also DDP over compiled blocks (plain dp2 adds no other path)
    ("dp2-recompute", LLAMA, dict(dp=2, recompute="full", compile=True)),
]


# ------------------------------------------------------------------------------------ pure
@pytest.mark.pure
def test_compile_is_off_by_default_and_refused_only_where_it_cannot_run():
    assert Plan().compile is False
    assert validate(Plan(dp=2, tp=2, compile=True), 4, PRESETS[LLAMA]) == []
    assert Plan(dp=2, compile=True).describe() == "dp2 compiled"
    (ep,) = _compile_problems(Plan(dp=2, ep=2, compile=True))
    assert "ep(2)" in ep and "recompile limit (8)" in ep
    (zb,) = _compile_problems(Plan(pp=2, pp_schedule="zbv", microbatches=4, compile=True))
    assert "'zbv'" in zb
    assert _compile_problems(Plan(dp=2, ep=2)) == []


@pytest.mark.pure
def test_compiling_changes_no_predicted_byte():
    """Beside the eager plan with the same layout, the vocabulary ends split under tp as eager's."""
    from interactive_parallel.plan.estimate import predict_comms, predict_memory

    spec = PRESETS[LLAMA]
    assert Plan(tp=2, compile=True).vocab_split and not Plan(tp=2, compile=True, vocab_parallel=False).vocab_split
    for fields in (dict(dp=2, tp=2), dict(tp=2, sequence_parallel=True), dict(fsdp=4), dict(pp=2, dp=2)):
        eager, compiled = Plan(**fields), Plan(**fields, compile=True)
        assert predict_memory(spec, compiled) == predict_memory(spec, eager)
        assert predict_comms(spec, compiled) == predict_comms(spec, eager)


@pytest.mark.pure
def test_the_panel_offers_compile_off_and_says_what_it_costs():
    import ipywidgets as widgets
    from fake_session import FakeSession

    from interactive_parallel.widgets import Panel
    from interactive_parallel.widgets.planner import COMPILE_NOTE

    p = Panel(FakeSession())
    box = p.plan_section.fields["compile"]
    assert isinstance(box, widgets.Checkbox) and box.value is False

    def shown() -> str:
        return html.unescape(re.sub(r"<[^>]+>", " ", p.plan_section.messages.value))

    assert "first training step compiles" not in shown()
    box.value = True
    assert COMPILE_NOTE in shown() and p.plan_section.plan().compile


@pytest.mark.pure
def test_the_exported_script_compiles_too():
    from interactive_parallel.runtime.client.export import script_text

    text = script_text(PRESETS[LLAMA], Plan(dp=2, tp=2, compile=True), 2)
    namespace: dict = {}
    exec(compile(text, "exported.py", "exec"), namespace)  # defines, main() is not run
    assert namespace["PLAN"].compile is True  # parallelize(SPEC, PLAN) compiles its blocks
    assert "parallelize(SPEC, PLAN" in text


# ------------------------------------------------------------------------------ one rank
def _graphs() -> int:
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.rank1
def test_blocks_compile_in_place_and_decoding_runs_them_eagerly():
    from interactive_parallel.runtime.inference.generate import generate
    from interactive_parallel.runtime.layout.parallelize import parallelize

    spec = PRESETS[LLAMA]
    eager, compiled = parallelize(spec, Plan()), parallelize(spec, Plan(compile=True))
    assert list(compiled.raw.state_dict()) == list(eager.raw.state_dict())  # no `_orig_mod.`
    layers = compiled.raw.model.layers
    assert all(b._compiled_call_impl is not None for b in layers)
    assert eager.raw.model.layers[0]._compiled_call_impl is None
    before = _graphs()
    assert generate(compiled, W.PROMPTS, 6) == generate(eager, W.PROMPTS, 6)
    assert _graphs() == before  # the decode step compiled nothing


@pytest.mark.rank1
def test_the_dry_run_of_a_compiled_plan_is_the_eager_ones_and_compiles_nothing():
    from interactive_parallel.runtime.client.dryrun import dry_run

    before = _graphs()
    got, ref = dry_run(LLAMA, Plan(dp=2, tp=2, compile=True)), dry_run(LLAMA, Plan(dp=2, tp=2))
    assert _graphs() == before
    for rank in ref.simulated:
        a, b = got.simulated[rank], ref.simulated[rank]
        assert a.memory == b.memory
        assert [W_key(c) for c in a.comms] == [W_key(c) for c in b.comms]


def W_key(c) -> tuple:
    return (c.op, c.bytes, c.dtype, c.axis, tuple(c.group), c.peer)


@pytest.mark.rank1
def test_a_compiled_layout_takes_the_sessions_cache_directory(tmp_path, monkeypatch):
    from interactive_parallel.records import ScratchLayout
    from interactive_parallel.runtime import api
    from interactive_parallel.runtime.rank import state

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    api.load_model(PRESETS[LLAMA])
    try:
        cache = ScratchLayout(str(tmp_path)).compile_cache
        api.apply_plan(Plan(), ScratchLayout(str(tmp_path)))
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != cache  # an eager plan leaves inductor alone
        api.apply_plan(Plan(compile=True), ScratchLayout(str(tmp_path)))
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == cache
        assert os.path.isdir(tmp_path / "compile")
    finally:
        state.get().reset_model()


# ----------------------------------------------------------------------------- multirank
@pytest.mark.multirank
@pytest.mark.slow
def test_compiled_layouts_at_parity_with_one_eager_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the spawned ranks inherit it
    results = run_ranks(W.parity_group, 2, CONFIGS_2, STEPS, timeout_s=900.0, collective_timeout_s=600.0)[0]
    ref = W.reference(LLAMA, {}, STEPS)  # reference_plan drops compile: one eager process
    for label, _model, _fields in CONFIGS_2:
        got = results[label]
        dloss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
        dgrad, dweight = W.max_diff(got["grads"], ref["grads"]), W.max_diff(got["weights"], ref["weights"])
        print(f"{label}: dloss {dloss:.2e} dgrad {dgrad:.2e} dweight {dweight:.2e}")
        assert dloss <= LOSS_TOL and dgrad <= GRAD_TOL and dweight <= WEIGHT_TOL, (label, dloss, dgrad, dweight)


# ------------------------------------------------------------------------------- session
@pytest.mark.session
@pytest.mark.slow
def test_a_session_compiles_into_its_scratch_directory_which_goes_at_stop():
    from conftest import live_session, single_process_losses, step_losses

    plan = Plan(dp=2, batch_size=4, seq_len=32, compile=True)
    with live_session(2) as s:  # checks the scratch directory is gone after stop
        s.load_model(LLAMA)
        s.apply(plan)
        records = s.train(2)
        cache = os.path.join(s.model.scratch.path, "compile")
        assert os.path.isdir(cache) and os.listdir(cache), "nothing compiled into the session's cache"
    losses = [step_losses(records)[step] for step in range(2)]
    ref = single_process_losses(2, batch_size=4, seq_len=32)
    assert max(abs(a - b) for a, b in zip(losses, ref)) <= LOSS_TOL
