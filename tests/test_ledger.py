"""The comm ledger against torch's CommDebugMode: every parity plan's step, the same collectives.

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
"""
from __future__ import annotations

import collections

import pytest

import ledger_workers as L
from mp_harness import run_ranks
from test_parallel_parity import ALL, CONFIGS_2, CONFIGS_4

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def beside() -> dict:
    """{label: {rank: {"ledger": [...], "counter": [...], "counts": {...}}}} of every parity plan."""
    out: dict = {}
    for world, configs in ((2, CONFIGS_2), (4, CONFIGS_4)):
        for rank, recs in enumerate(run_ranks(L.ledger_beside_counter, world, configs, timeout_s=600)):
            for label, value in recs.items():
                out.setdefault(label, {})[rank] = value
    return out


@pytest.mark.parametrize("label", list(ALL))
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
    gradient comes out Partial and DTensor all-reduces it (hidden 64, fp32), in its dispatch."""
    for rank, got in beside["llama-tp2-sp"].items():
        assert collections.Counter(got["ledger"])[("all_reduce", 64 * 4, (0, 1))] > 0, rank
        assert all(op != "all_reduce" or nbytes == 64 * 4 for op, nbytes, _ in got["ledger"]), rank
