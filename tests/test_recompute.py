"""Activation recomputation (Plan.recompute): parity and activation memory.

Parity: 'selective' and 'full' under dp, tp, fsdp and pp (and one 2-D combination) against
the single-process run without recomputation: per-step losses of 3 AdamW steps, the next
batch's loss and full gradients, the final weights, with the parity tolerances of
test_parallel_parity (recomputing reruns the same kernels on the same inputs: the
measured differences are those of the layouts themselves).
Memory (one process, tiny-llama, batch 8x64): the activation peak of a forward/backward
measured by torch's MemTracker (which also sees what checkpointed layers keep; the step
probe's saved-tensor hooks do not) falls none > selective > full, and each is within
a factor of ACT_FACTOR of predict_activations.
"""
from __future__ import annotations

import pytest

from mp_harness import run_ranks
import parity_workers as W
import state_workers as S

pytestmark = pytest.mark.multirank
ACT_FACTOR = 2.0

LOSS_TOL, GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-5, 1e-4
STEPS = 3
LLAMA = "tiny-llama"
CONFIGS_2 = [
    ("dp2-selective", LLAMA, dict(dp=2, recompute="selective")),
    ("dp2-full", LLAMA, dict(dp=2, recompute="full")),
    ("tp2-selective", LLAMA, dict(tp=2, recompute="selective")),
    ("tp2-full", LLAMA, dict(tp=2, recompute="full")),
    ("fsdp2-selective", LLAMA, dict(fsdp=2, recompute="selective")),
    ("fsdp2-full", LLAMA, dict(fsdp=2, recompute="full")),
    ("pp2-selective", LLAMA, dict(pp=2, recompute="selective")),
    ("pp2-full", LLAMA, dict(pp=2, recompute="full")),
    ("gpt2-tp2-full", "tiny-gpt2", dict(tp=2, recompute="full")),
]
CONFIGS_4 = [("fsdp2xtp2-selective", LLAMA, dict(fsdp=2, tp=2, recompute="selective"))]
ALL = {label: (preset, fields) for label, preset, fields in CONFIGS_2 + CONFIGS_4}


@pytest.fixture(scope="module")
def results():
    out = dict(run_ranks(W.parity_group, 2, CONFIGS_2, STEPS)[0])
    out.update(run_ranks(W.parity_group, 4, CONFIGS_4, STEPS)[0])
    return out


@pytest.mark.parametrize("label", list(ALL))
def test_recompute_parity(results, label):
    preset, fields = ALL[label]
    ref, got = W.reference(preset, {}, STEPS), results[label]
    dloss = max(abs(a - b) for a, b in zip(ref["losses"], got["losses"]))
    assert dloss <= LOSS_TOL, f"{label}: losses {got['losses']} vs {ref['losses']}"
    assert W.max_diff(ref["grads"], got["grads"]) <= GRAD_TOL, label
    assert W.max_diff(ref["weights"], got["weights"]) <= WEIGHT_TOL, label


def test_activation_memory_measured_and_predicted():
    got = {mode: S.recompute_activations(LLAMA, dict(recompute=mode)) for mode in ("none", "selective", "full")}
    for mode, r in got.items():
        print(f"{mode}: measured {r['measured'] / 2**20:.2f} MiB, predicted {r['predicted'] / 2**20:.2f} MiB")
        assert r["predicted"] / ACT_FACTOR <= r["measured"] <= r["predicted"] * ACT_FACTOR, (mode, r)
    assert got["none"]["measured"] > got["selective"]["measured"] > got["full"]["measured"], got
