"""Activation recomputation (Plan.recompute): parity and activation memory.

Parity: 'selective' and 'full' under dp, tp (with and without sequence parallelism), fsdp and pp (and one 2-D combination) against
the single-process run without recomputation: per-step losses of 3 AdamW steps, the next
batch's loss and full gradients, the final weights, with the parity tolerances of
test_parallel_parity (recomputing reruns the same kernels on the same inputs: the
measured differences are those of the layouts themselves).
Memory: one training step of every plan above in fp32 and bf16 on spawned ranks; the step
probe's activation peak (which sees what checkpointing keeps: runtime/probes/memory.py) is
within ACT_TOLERANCE of plan/activations' prediction on every rank, falls none > selective >
full, and a dry run of the same plan records the same bytes.
"""
from __future__ import annotations

import pytest

from mp_harness import run_ranks
import parity_workers as W
from interactive_parallel import Plan, dry_run
from interactive_parallel.plan import PRESETS
from interactive_parallel.plan.estimate import predict_memory
from test_activations import ACT_TOLERANCE

pytestmark = pytest.mark.multirank

LOSS_TOL, GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-5, 1e-4
STEPS = 3
LLAMA = "tiny-llama"
CONFIGS_2 = [
    ("dp2-selective", LLAMA, dict(dp=2, recompute="selective")),
    ("dp2-full", LLAMA, dict(dp=2, recompute="full")),
    ("tp2-selective", LLAMA, dict(tp=2, recompute="selective")),
    ("tp2-full", LLAMA, dict(tp=2, recompute="full")),
    # Sequence parallelism cuts the residual stream at a layer's input: its recomputation must
    # start from the cut it saved, not cut it again.
    ("tp2-sp-full", LLAMA, dict(tp=2, sequence_parallel=True, recompute="full")),
    ("tp2-sp-selective", LLAMA, dict(tp=2, sequence_parallel=True, recompute="selective")),
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


@pytest.fixture(scope="module")
def memory():
    """{(label, precision): {rank: MemoryRecord}} of one training step."""
    out: dict = {}
    for world, configs in ((2, CONFIGS_2), (4, CONFIGS_4)):
        for precision in ("fp32", "bf16"):
            for rank, recs in enumerate(run_ranks(W.one_step_records, world, configs, precision)):
                for label, (mem, _, _) in recs.items():
                    out.setdefault((label, precision), {})[rank] = mem
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("label", list(ALL))
def test_activation_memory_measured_predicted_and_dry_run(memory, label, precision):
    preset, fields = ALL[label]
    plan = Plan(**fields, precision=precision)
    predicted, dry = predict_memory(PRESETS[preset], plan), dry_run(preset, plan).memory()
    for rank, m in memory[label, precision].items():
        p = predicted[rank]
        assert abs(p.activations - m.activations) <= ACT_TOLERANCE * m.activations, (rank, p.activations, m)
        assert dry[rank].activations == m.activations, rank


def test_recomputation_keeps_less(memory):
    """Rank 0, fp32: without recomputation (the model is exact there: test_activations) more than
    selective, which keeps more than full."""
    for layout in ("dp2", "tp2", "fsdp2", "pp2"):
        selective, full = (memory[f"{layout}-{mode}", "fp32"][0].activations for mode in ("selective", "full"))
        plain = predict_memory(PRESETS[LLAMA], Plan(**{**ALL[f"{layout}-full"][1], "recompute": "none"}))[0]
        assert plain.activations > selective > full, layout
