"""The comm ledger against torch's CommDebugMode: every parity plan's step, the same collectives,
each with its cause; and the same step untraced, the same numbers.

Oracle: torch's CommDebugMode (tests/ledger_workers.py: its own counting, each op it counts
noted with its kind, bytes and group by the ledger's conventions restated there). Every parity
plan (tests/test_parallel_parity.py) runs one training step per rank, in one spawned group per
world size, with the ledger on inside the mode. Per rank the two must hold the same multiset of
(op, bytes, group): the wrappers' collectives (DDP's bucket all-reduces, FSDP2's gathers and
reduce-scatters, the pipeline's sends and receives, CP's gathers), the explicit redistributes
of TP's styles, and those DTensor issues inside its own dispatch (an implicit redistribute,
loss_parallel's cross-entropy all-reduces, a Partial gradient's reduction), which a kernel at
the Autograd keys never saw. Where the two legitimately differ, and how the test reads it:
CommDebugMode's registry holds collectives only, so its counts leave out the point-to-point
sends and receives (the mode passes them by; its `.seen` notes them, its counts are compared
with the ledger's collectives alone); ops issued in inference mode are left out of the ledger
by design (the loop's stop vote, runtime/rank/channel.py), and a training step issues none.

Causes (runtime/probes/causes.py): every collective names its module or wrapper, the op that
needed it and its phase; the layouts' known collectives are named as torch's TP styles, FSDP2,
DDP, the pipeline schedule and CP issue them (oracle: what each wrapper documents it does). The
same step run again with tracing off gives a bitwise-equal loss and weights.
"""
from __future__ import annotations

import collections
import json

import pytest

import ledger_workers as L
from mp_harness import run_ranks
from interactive_parallel import Plan
from interactive_parallel.records import CommRecord
from test_parallel_parity import ALL, CONFIGS_2, CONFIGS_4

pytestmark = pytest.mark.multirank

EP = ("mixtral-dp2-ep2", "mixtral", dict(dp=2, ep=2, batch_size=8, seq_len=16))
"""Expert parallelism beside the parity plans: transformers' all-to-all dispatch and combine (tests/moe_workers.py's
tiny Mixtral)."""


@pytest.fixture(scope="module")
def beside() -> dict:
    """{label: {rank: {"ledger": [...], "counter": [...], "counts": {...}}}} of every parity plan (and EP)."""
    import moe_workers as M

    out: dict = {}
    ep = (EP[0], M.spec_of(EP[1]), EP[2])
    for world, configs in ((2, CONFIGS_2 + [ep]), (4, CONFIGS_4)):
        for rank, recs in enumerate(run_ranks(L.ledger_beside_counter, world, configs, timeout_s=600)):
            for label, value in recs.items():
                out.setdefault(label, {})[rank] = value
    return out


@pytest.mark.parametrize("label", list(ALL) + [EP[0]])
def test_the_ledger_records_what_commdebugmode_counts(beside, label):
    for rank, got in beside[label].items():
        ledger, seen = collections.Counter(got["ledger"]), collections.Counter(got["counter"])
        assert ledger == seen, (rank, "ledger only:", ledger - seen, "CommDebugMode only:", seen - ledger)
        collectives = sum(n for (op, _, _), n in ledger.items() if op not in ("send", "recv"))
        assert sum(got["counts"].values()) == collectives, (rank, got["counts"])


@pytest.mark.parametrize("label", ["llama-tp2-lp", "llama-tp2-sp-lp", "gpt2-tp2-lp"])
def test_loss_parallel_cross_entropy_all_reduces_are_recorded(beside, label):
    """torch's loss_parallel all-reduces the split logits' max, their exponentials' sum and the
    target's logit, one fp32 per token (8 x 64 here), inside DTensor's dispatch."""
    for rank, got in beside[label].items():
        assert collections.Counter(got["ledger"])[("all_reduce", 8 * 64 * 4, (0, 1))] == 3, rank


def test_sequence_parallel_norm_gradients_are_reduced_where_the_ledger_sees_it(beside):
    """Sequence parallel: a norm's replicated weight meets sequence-split activations, so its
    gradient comes out Partial and DTensor all-reduces it (hidden 64, fp32), in its dispatch; the
    other two all-reduces are the vocabulary ends' (the embedding's output, the head's input
    gradient: [tokens, 64] each)."""
    for rank, got in beside["llama-tp2-sp"].items():
        assert collections.Counter(got["ledger"])[("all_reduce", 64 * 4, (0, 1))] > 0, rank
        ends = [nbytes for op, nbytes, _ in got["ledger"] if op == "all_reduce" and nbytes != 64 * 4]
        assert len(ends) == 2 and len(set(ends)) == 1 and ends[0] % (64 * 4) == 0, rank


# ---------------------------------------------------------------- causes


def _traced(beside, label: str, rank: int = 0) -> list[CommRecord]:
    return [CommRecord.from_dict(d) for d in beside[label][rank]["causes"]]


@pytest.mark.parametrize("label", list(ALL) + [EP[0]])
def test_every_collective_has_a_cause_and_tracing_changes_no_number(beside, label):
    for rank, got in beside[label].items():
        assert got["same_numbers"], (rank, "a traced step's loss or weights differ from the untraced one's")
        traced = _traced(beside, label, rank)
        for c in traced:
            assert (c.module or c.needed_by) and c.phase in ("forward", "backward", "optimizer"), c
            assert bool(c.placements) == (c.implicit is not None), c
            assert CommRecord.from_dict(json.loads(json.dumps(c.to_dict()))) == c
        untraced = [CommRecord.from_dict(d) for d in got["untraced"]]
        assert collections.Counter((c.op, c.bytes) for c in untraced) == \
            collections.Counter((c.op, c.bytes) for c in traced), rank
        assert all(c.module == c.needed_by == c.placements == c.phase == "" and c.implicit is None for c in untraced)


VOCAB_ENDS = ("model.embed_tokens", "lm_head")


def _check_vocab_ends(recs: list[CommRecord]) -> None:
    """The vocabulary-split embedding's output summed over tp in its output hook (a MaskPartial,
    explicit), the head's input gradient all-reduced in backward, and (no loss parallel) its
    logits all-gathered in its output hook."""
    embed = [c for c in recs if c.module == "model.embed_tokens"]
    assert [(c.op, c.placements, c.implicit) for c in embed] == [("all_reduce", "MaskP(sum) -> R on tp", False)]
    head = sorted((c.op, c.phase, c.placements) for c in recs if c.module == "lm_head")
    assert head == [("all_gather", "forward", "S(2) -> R on tp"), ("all_reduce", "backward", "P(sum) -> R on tp")], head


def _check_tp(recs: list[CommRecord]) -> None:
    """RowwiseParallel all-reduces its output (P -> R, in the linear's forward hook);
    ColwiseParallel's input, made with from_local, gets its gradient all-reduced in backward.
    The vocabulary ends' own are checked apart (_check_vocab_ends)."""
    _check_vocab_ends(recs)
    recs = [c for c in recs if c.module not in VOCAB_ENDS]
    fwd = [c for c in recs if c.phase == "forward"]
    bwd = [c for c in recs if c.phase == "backward"]
    assert len(fwd) == 8 and len(bwd) == 20
    assert all(c.module.endswith(("o_proj", "down_proj")) and c.needed_by == "redistribute" and
               c.placements == "P(sum) -> R on tp" and c.implicit is False for c in fwd), fwd
    assert all(c.module.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) and
               c.needed_by == "from_local (backward)" and c.placements == "P(sum) -> R on tp" for c in bwd), bwd
    assert len({c.module for c in bwd}) == 20  # each colwise linear once


def test_tp_all_reduces_are_named_by_their_linears(beside):
    for rank in (0, 1):
        _check_tp(_traced(beside, "llama-tp2", rank))


def test_loss_parallel_names_its_cross_entropy_ops(beside):
    recs = _traced(beside, "llama-tp2-lp")
    loss = [c for c in recs if c.bytes == 8 * 64 * 4]
    assert sorted(c.needed_by for c in loss) == ["aten._log_softmax", "aten._log_softmax", "aten.nll_loss_forward"]
    assert all(c.module == "" and c.phase == "forward" and c.implicit is None for c in loss)
    embed = [c for c in recs if c.module == "model.embed_tokens"]
    assert [(c.placements, c.implicit) for c in embed] == [("MaskP(sum) -> R on tp", False)]
    assert [c.needed_by for c in recs if c.module == "lm_head"] == ["from_local (backward)"]


def test_sequence_parallel_and_its_norm_gradient_reductions(beside):
    """Sequence parallel gathers each block's input (S(1) -> R, in the attention's and the MLP's
    input hooks) and reduce-scatters its output (P -> S(1)). A norm's weight stays replicated
    beside sequence-split activations, so its gradient is Partial: under tp alone the runtime
    sums it once after backward (Parallelized.finish_grads, named by the norm; left to the
    optimizer, each AdamW op reading it would all-reduce it again, implicitly: tests/test_lint.py
    shows that with the reduction off); under dp x tp, replicate reduces it once, explicitly,
    after backward. Nothing of the step is implicit."""
    recs = _traced(beside, "llama-tp2-sp")
    _check_vocab_ends(recs)
    gathers = [c for c in recs if c.op == "all_gather" and c.phase == "forward" and c.module not in VOCAB_ENDS]
    assert {c.module.rsplit(".", 1)[-1] for c in gathers} >= {"self_attn", "mlp"}
    assert all(c.placements == "S(1) -> R on tp" and c.implicit is False for c in gathers)
    scatters = [c for c in recs if c.op == "reduce_scatter" and c.phase == "forward"]
    assert all(c.module.endswith(("o_proj", "down_proj")) and c.placements == "P(sum) -> S(1) on tp" for c in scatters)
    norms = [c for c in recs if c.op == "all_reduce" and c.module not in VOCAB_ENDS]
    assert len(norms) == 8 and all(c.phase == "backward" and c.implicit is False and c.needed_by == "redistribute" and
                                   c.placements == "P(sum) -> R on tp" for c in norms)
    assert collections.Counter(c.module.rsplit(".", 1)[-1] for c in norms) == \
        {"input_layernorm": 4, "post_attention_layernorm": 4}
    assert not any(c.implicit for c in recs)
    replicated = [c for c in _traced(beside, "llama-dp2xtp2-sp") if c.op == "all_reduce" and c.axis == "tp"
                  and c.module not in VOCAB_ENDS]
    assert len(replicated) == 8 and all(c.module.startswith("replicate unit model.layers.") and
                                        c.implicit is False and c.phase == "backward" for c in replicated)


def test_wrappers_name_their_units(beside):
    assert [(c.module, c.needed_by, c.phase) for c in _traced(beside, "llama-dp4")] == \
        [("ddp bucket 0", "bucket all-reduce", "backward")]
    units = {f"fsdp unit model.layers.{i}" for i in range(4)} | {"fsdp unit LlamaForCausalLM"}
    for label in ("llama-fsdp4", "llama-hsdp-dp2xfsdp2"):
        recs = _traced(beside, label)
        assert {c.module for c in recs} == units, label
        assert {(c.op, c.needed_by) for c in recs} <= {("all_gather", "unshard"), ("reduce_scatter", "post_backward"),
                                                       ("all_reduce", "post_backward")}, label
    gathers = [c for c in _traced(beside, "llama-cp2") if c.op == "all_gather"]
    assert len(gathers) == 8 and all(c.module.endswith("self_attn") and c.needed_by == "cp._GatherSeq.forward"
                                     for c in gathers)
    tied = [c for c in _traced(beside, "gpt2-pp2") if c.op == "all_reduce"]
    assert [(c.needed_by, c.phase) for c in tied] == [("parallelized.Parallelized.finish_grads", "backward")]


@pytest.mark.parametrize("label", ["llama-pp2-interleaved", "llama-pp2-zbv", "llama-pp4"])
def test_pipeline_hops_name_their_stages(beside, label):
    """A stage's activations go to the next stage and its input gradients to the previous one;
    each send leaves a stage this rank holds and each receive reaches one (besides the 4-byte
    votes on static shapes before the first step, named by the schedule's own step)."""
    plan = Plan(**ALL[label][1])
    for rank, got in beside[label].items():
        mine = set(plan.stage_ids(rank))
        for c in _traced(beside, label, rank):
            if c.bytes == 4:
                assert c.module == "pipeline" and c.needed_by.startswith("warmup_"), c
                continue
            a, b = map(int, c.module.removeprefix("pipeline stage ").split(" -> "))
            assert abs(a - b) == 1 and (a if c.op == "send" else b) in mine, (rank, c)
            assert (c.needed_by, c.phase) == (("activations", "forward") if b > a else ("gradients", "backward")), c


def test_expert_parallel_all_to_alls_name_their_layer(beside):
    """transformers' AllToAllEP exchanges counts then tokens (dispatch) and brings them back
    (combine) per MoE layer; backward runs the two token all-to-alls' autograd formula in the experts."""
    recs = [c for c in _traced(beside, EP[0]) if c.op == "all_to_all"]
    fwd = [(c.module, c.needed_by) for c in recs if c.phase == "forward"]
    assert fwd == [(f"ep {what} layer {i}", what) for i in range(4) for what in ("dispatch", "dispatch", "combine")]
    bwd = [(c.module, c.needed_by) for c in recs if c.phase == "backward"]
    assert bwd == [(f"model.layers.{i}.mlp.experts", "all_to_all_single (backward)") for i in (3, 2, 1, 0) for _ in "ab"]
