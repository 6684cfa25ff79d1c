"""The layout lint (runtime/layout/lint.py): what it names on broken layouts, and that it names nothing
wrong on any parity plan.

Each layout is built as a rank builds it (runtime.layout.parallelize, the same code), on meta
tensors in this process, joined to torch's fake process group as each rank in turn: the lint
reads placements only, so it needs no storage and no peer (a parity sweep costs seconds).
Oracles: notebook 06's broken layouts, made the way the notebook makes them (a family's TP plan
replaced, as its `set_tp_style` does on the ranks; a norm dropped from the family's norm_paths,
so sequence parallelism leaves it a plain tensor beside sequence-split tokens), which
tests/test_session_parallel.py shows verify() failing on; the parity plans of
tests/test_parallel_parity.py, whose numbers equal one process's (so a 'wrong' finding on one
is a false alarm); and, for the cost the lint predicts, the dry run's implicit redistributes
(tests/test_dryrun.py holds every parity plan's to the lint's prediction).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses

import pytest

from interactive_parallel import Plan
from interactive_parallel.plan import PRESETS, models
from interactive_parallel.records import LintFinding, LintKind
from test_parallel_parity import ALL

pytestmark = pytest.mark.rank1


@contextlib.contextmanager
def as_rank(rank: int, world: int):
    """This process joined to torch's fake process group as `rank` of `world` (as the dry run joins)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from interactive_parallel.runtime.client.dryrun import _forget_groups

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        _forget_groups()


def lint_every_rank(spec, plan: Plan, edit=None) -> list[LintFinding]:
    """Every rank's findings on `plan`'s layout of `spec` (meta tensors); `edit(par)` first, if given."""
    from interactive_parallel.runtime.layout.lint import lint
    from interactive_parallel.runtime.layout.parallelize import parallelize

    out = []
    for rank in range(plan.world_size):
        with as_rank(rank, plan.world_size):
            par = parallelize(spec, plan, device="cpu", materialize=False)
            if edit is not None:
                edit(par)
            out += lint(par)
    return out


@pytest.fixture
def gpt2_family(monkeypatch):
    """Replace GPT-2's family facts in this process, as notebook 06's set_tp_style does on the ranks
    (restored after the test)."""
    def set_family(**changes):
        monkeypatch.setitem(models.FAMILIES, "gpt2", dataclasses.replace(models.FAMILIES["gpt2"], **changes))
    return set_family


def test_notebook_06_qkv_split_without_its_permutation_is_named(gpt2_family):
    """The notebook's bug: `transformer.h.*.attn.c_attn` styled plain 'colwise'. Every layer's fused
    projection (weight and bias) is named on tp, with rank 0's share of q, k and v (checkpoint
    order: all of q, half of k), and nothing else is wrong."""
    fam = models.FAMILIES["gpt2"]
    gpt2_family(tp_plan=dict(fam.tp_plan, **{"transformer.h.*.attn.c_attn": "colwise"}))
    found = lint_every_rank(PRESETS["tiny-gpt2"], Plan(tp=2))
    wrong = {(f.param, f.axis, f.fault) for f in found if f.severity == "wrong"}
    assert wrong == {(f"transformer.h.{i}.attn.c_attn.{leaf}", "tp", LintKind.SPLIT_FUSED)
                     for i in range(4) for leaf in ("weight", "bias")}
    assert all("features 0-95 (q 100%, k 50%, v 0%)" in f.why and "colwise_fused_qkv" in f.fix for f in found)


def test_notebook_06_norm_left_unsynchronised_is_named(gpt2_family):
    """A norm left out of sequence parallelism (dropped from norm_paths): its weight and bias stay
    plain tensors on tp while the block's tokens are split over tp, so nothing sums their
    gradients over tp. Named per parameter on tp, and nothing else (the norm that is still
    sequence parallel has its Partial gradient summed once after backward)."""
    gpt2_family(norm_paths=("ln_1",))
    found = lint_every_rank(PRESETS["tiny-gpt2"], Plan(tp=2, sequence_parallel=True))
    wrong = collections.Counter((f.param, f.axis, f.fault) for f in found if f.severity == "wrong")
    assert wrong == {(f"transformer.h.{i}.ln_2.{leaf}", "tp", LintKind.GRAD_NOT_REDUCED): 2
                     for i in range(4) for leaf in ("weight", "bias")}
    assert all("sequence parallelism cuts the block's tokens over tp" in f.why for f in found)
    assert [f for f in found if f.severity != "wrong"] == []


@pytest.mark.parametrize("label", list(ALL))
def test_no_false_alarm_on_a_parity_plan(label):
    """Every parity plan's numbers equal one process's: the lint names nothing on any rank, neither
    wrong nor cost (sequence parallelism's norm gradients are summed once after backward:
    tests/test_ledger.py)."""
    preset, fields = ALL[label]
    found = lint_every_rank(PRESETS[preset], Plan(**fields))
    assert found == []


@pytest.fixture
def partial_reduction():
    """Sets the runtime's reduction of Partial gradients on or off for one test (restored after)."""
    from interactive_parallel.runtime.layout import parallelized

    before = parallelized.REDUCE_PARTIAL[0]
    yield lambda flag: parallelized.REDUCE_PARTIAL.__setitem__(0, flag)
    parallelized.REDUCE_PARTIAL[0] = before


def test_without_the_runtimes_reduction_the_norms_are_named_as_cost(partial_reduction):
    """With Parallelized.finish_grads' reduction of Partial gradients off, sequence parallelism's
    norms under tp alone are named (cost, on tp): the optimizer's ops would all-reduce them."""
    partial_reduction(False)
    preset, fields = ALL["llama-tp2-sp"]
    found = lint_every_rank(PRESETS[preset], Plan(**fields))
    norms = PRESETS[preset].family_info.norm_paths
    assert found and all(f.fault == LintKind.IMPLICIT_REDISTRIBUTE and f.axis == "tp" and f.severity == "cost" and
                         f.param.split(".")[-2] in norms for f in found), found


def test_a_parameter_no_wrapper_reduces_is_named_on_its_data_axis():
    """A parameter left out of FSDP (here: made a plain tensor again after fully_shard) has a gradient
    of its rank's batch only: named on fsdp."""
    from torch import nn

    def unshard(par):
        norm = par.raw.get_submodule("model.norm")
        norm.weight = nn.Parameter(norm.weight.to_local().clone())

    found = lint_every_rank(PRESETS["tiny-llama"], Plan(fsdp=2), unshard)
    assert {(f.param, f.axis, f.fault, f.severity) for f in found} == \
        {("model.norm.weight", "fsdp", LintKind.GRAD_NOT_REDUCED, "wrong")}


def test_a_hook_beside_dtensors_own_reduction_is_named_reduced_twice():
    def hook(par):
        par.raw.get_submodule("model.layers.1.input_layernorm").weight.register_hook(lambda g: g)

    found = lint_every_rank(PRESETS["tiny-llama"], Plan(tp=2, sequence_parallel=True), hook)
    assert {(f.param, f.fault) for f in found if f.severity == "wrong"} == \
        {("model.layers.1.input_layernorm.weight", LintKind.REDUCED_TWICE)}


def test_a_style_handing_on_a_partial_sum_is_named(monkeypatch):
    """A rowwise style whose output stays Partial, handed on as a plain tensor (use_local_output)."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import RowwiseParallel

    from interactive_parallel.runtime.parallel import tp

    built = tp.layer_tp_plan

    def partial_down(spec, layer_ids, sequence_parallel):
        styles = built(spec, layer_ids, sequence_parallel)
        styles["model.layers.0.mlp.down_proj"] = RowwiseParallel(output_layouts=Partial())
        return styles

    monkeypatch.setattr(tp, "layer_tp_plan", partial_down)
    found = lint_every_rank(PRESETS["tiny-llama"], Plan(tp=2))
    assert {(f.param, f.axis, f.fault) for f in found} == {("model.layers.0.mlp.down_proj", "tp", LintKind.PARTIAL_OUTPUT)}


def test_an_uneven_shard_is_named_with_its_axis():
    """fsdp(4) over a vocabulary of 130: the embedding and head shards differ (FSDP pads: a cost)."""
    from interactive_parallel.runtime.model.families import resolved

    spec = resolved({**PRESETS["tiny-llama"].config, "vocab_size": 130})
    found = lint_every_rank(spec, Plan(fsdp=4, batch_size=8))
    assert {(f.param, f.axis, f.fault, f.severity) for f in found} == \
        {(p, "fsdp", LintKind.NOT_DIVISIBLE, "cost") for p in ("model.embed_tokens.weight", "lm_head.weight")}


def assert_implicit_redistributes_predicted(d) -> None:
    """A dry run's implicit redistributes are those its lint predicts: per rank, each parameter named
    IMPLICIT_REDISTRIBUTE is all-reduced over tp by the optimizer (one aten.lerp_ each, AdamW's
    first read of the gradient), or is a vocabulary-split embedding whose module's own forward
    reads its partial rows (Gemma 3's scale: that module's forward all-reduce, implicit), and no
    other collective of the step is implicit."""
    for rank in range(d.world):
        implicit = [c for c in d.comms(rank) if c.implicit]
        predicted = [f for f in d.lint() if rank in f.ranks and f.fault == LintKind.IMPLICIT_REDISTRIBUTE]
        ends = {f.param.rsplit(".", 1)[0] for f in predicted if "looked-up rows" in f.why}
        assert {c.module for c in implicit if c.phase == "forward"} == ends, rank
        implicit = [c for c in implicit if c.phase != "forward"]
        predicted = [f for f in predicted if f.param.rsplit(".", 1)[0] not in ends]
        assert all(c.phase == "optimizer" and c.placements == "P(sum) -> R on tp" for c in implicit), rank
        assert sum(c.needed_by == "aten.lerp_" for c in implicit) == len(predicted), rank
        assert bool(implicit) == bool(predicted), rank


@pytest.mark.parametrize("reduce", [True, False], ids=["reduced", "left-to-the-optimizer"])
@pytest.mark.parametrize("label", ["llama-tp2-sp", "gpt2-pp2xtp2-sp", "llama-dp2xtp2-sp"])
def test_the_predicted_implicit_redistributes_are_the_dry_runs(label, reduce, partial_reduction):
    """Sequence parallelism's plans: with the runtime's reduction of Partial gradients on (the
    default) the lint predicts no implicit all-reduce and the step has none; with it off, the lint
    predicts them under tp alone and none under dp x tp (replicate reduces the norms' gradients
    once); every parity plan's is held to it in tests/test_dryrun.py."""
    from interactive_parallel import dry_run

    partial_reduction(reduce)
    preset, fields = ALL[label]
    d = dry_run(preset, Plan(**fields))
    assert_implicit_redistributes_predicted(d)
    assert bool(d.lint()) == (not reduce and label != "llama-dp2xtp2-sp")
