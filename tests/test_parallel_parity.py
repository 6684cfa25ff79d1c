"""Parity of every parallel layout against one process: same seed, weights and global batch.

Each world size is spawned once (conftest.parity_runs, whose groups also record the first steps
the activation, comms-model and dry-run tests compare with) and runs all its plans in turn; the
tests then compare per-step losses of 3 AdamW steps (fp32), the loss and full gradients
of the next batch, and the final weights with the single-process run; each plan runs a second
time with gradient clipping (Plan.max_grad_norm), its norms compared too.
Tolerances (absolute): loss LOSS_TOL = 1e-5, gradients GRAD_TOL = 1e-5, weights after
3 AdamW steps WEIGHT_TOL = 1e-4 (AdamW divides by sqrt(v): a gradient that differs by
1e-8 where it is itself ~1e-8 moves a weight by up to lr = 1e-3 times a ratio, so
weights get a looser bound than gradients; measured ~1e-5).
"""
from __future__ import annotations

import pytest

import parity_workers as W

pytestmark = pytest.mark.multirank

LOSS_TOL, GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-5, 1e-4
STEPS = 3

LLAMA, GPT2 = "tiny-llama", "tiny-gpt2"
CONFIGS_2 = [
    ("llama-tp2", LLAMA, dict(tp=2)),
    ("llama-tp2-sp", LLAMA, dict(tp=2, sequence_parallel=True)),
    ("llama-pp2-gpipe", LLAMA, dict(pp=2, pp_schedule="gpipe")),
    ("llama-pp2-1f1b", LLAMA, dict(pp=2, pp_schedule="1f1b")),
    ("llama-pp2-interleaved", LLAMA, dict(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2)),
    ("llama-pp2-1f1b-accum2-mb4", LLAMA, dict(pp=2, microbatches=4, grad_accum=2)),
    ("llama-pp2-uneven-1-3", LLAMA, dict(pp=2, stage_layers=(1, 3))),
    ("llama-pp2-interleaved-zb", LLAMA, dict(pp=2, pp_schedule="interleaved-zb", virtual_stages=2)),
    ("llama-pp2-zbv", LLAMA, dict(pp=2, pp_schedule="zbv")),
    ("llama-pp2-dualpipev", LLAMA, dict(pp=2, pp_schedule="dualpipev", microbatches=4)),
    ("llama-cp2", LLAMA, dict(cp=2)),
    ("gpt2-pp2", GPT2, dict(pp=2)),
    ("gpt2-tp2", GPT2, dict(tp=2)),  # tp plans split the embedding and head on the vocabulary (tied: once)
    ("llama-tp2-whole-vocab", LLAMA, dict(tp=2, vocab_parallel=False)),  # a lesson's baseline: both ends whole
    # loss parallel: the logits kept split on the vocabulary, the loss taken on them
    ("llama-tp2-lp", LLAMA, dict(tp=2, loss_parallel=True)),
    ("llama-tp2-sp-lp", LLAMA, dict(tp=2, sequence_parallel=True, loss_parallel=True)),
    ("gpt2-tp2-lp", GPT2, dict(tp=2, loss_parallel=True)),  # tied: one weight split once
]
CONFIGS_4 = [
    ("llama-dp4", LLAMA, dict(dp=4)),
    ("llama-fsdp4", LLAMA, dict(fsdp=4)),
    ("llama-tp4", LLAMA, dict(tp=4)),
    ("llama-pp4", LLAMA, dict(pp=4)),
    ("llama-dp2xtp2", LLAMA, dict(dp=2, tp=2)),
    ("llama-fsdp2xtp2", LLAMA, dict(fsdp=2, tp=2)),
    ("llama-hsdp-dp2xfsdp2", LLAMA, dict(dp=2, fsdp=2)),
    ("llama-pp2xtp2", LLAMA, dict(pp=2, tp=2)),
    ("llama-pp2xdp2", LLAMA, dict(pp=2, dp=2)),
    # Zero-bubble schedules, each beside another axis (FSDP keeps its stages unsharded between the halves)
    ("llama-pp2xdp2-zbv", LLAMA, dict(pp=2, dp=2, pp_schedule="zbv")),
    ("llama-pp2xfsdp2-dualpipev", LLAMA, dict(pp=2, fsdp=2, pp_schedule="dualpipev", microbatches=4)),
    ("llama-pp2xtp2-interleaved-zb", LLAMA, dict(pp=2, tp=2, pp_schedule="interleaved-zb")),
    ("llama-cp2xtp2", LLAMA, dict(cp=2, tp=2)),
    ("llama-cp2xdp2", LLAMA, dict(cp=2, dp=2)),
    ("llama-dp2xtp2-sp", LLAMA, dict(dp=2, tp=2, sequence_parallel=True)),
    ("gpt2-dp2xtp2", GPT2, dict(dp=2, tp=2)),
    ("gpt2-pp2xtp2-sp", GPT2, dict(pp=2, tp=2, sequence_parallel=True)),
    ("gpt2-pp2xfsdp2", GPT2, dict(pp=2, fsdp=2)),
    ("llama-dp2xtp2-lp", LLAMA, dict(dp=2, tp=2, loss_parallel=True)),
    ("llama-fsdp2xtp2-lp", LLAMA, dict(fsdp=2, tp=2, loss_parallel=True)),
    ("gpt2-pp2xtp2-lp", GPT2, dict(pp=2, tp=2, loss_parallel=True)),  # tied across stages
]
ALL = {label: (preset, fields) for label, preset, fields in CONFIGS_2 + CONFIGS_4}

BF16_4 = [
    ("llama-fsdp4-bf16", LLAMA, dict(fsdp=4)),
    ("llama-hsdp-dp2xfsdp2-bf16", LLAMA, dict(dp=2, fsdp=2)),
    ("llama-fsdp2xtp2-sp-lp-bf16-clip", LLAMA, dict(fsdp=2, tp=2, sequence_parallel=True, loss_parallel=True,
                                                    max_grad_norm=1.0)),
    ("gpt2-pp2xfsdp2-bf16", GPT2, dict(pp=2, fsdp=2)),  # tied across stages, bf16 sends
]
"""FSDP gathering bf16 parameters (Plan.gathers_bf16), against one process computing on bf16 copies
of its parameters (runtime.training.verify.computes_like), at verify()'s bf16 bound."""
BF16 = [(label, preset, {**fields, "precision": "bf16"}) for label, preset, fields in BF16_4]


CLIP = 1.0
"""max_grad_norm of the clipped runs (torchtitan's and transformers' Trainer's default): below
every step's norm here (2.1-4.7), so every step clips."""
NORM_TOL = 1e-5
"""The norm before clipping, relative: the same squares summed in another order."""


def clipped(configs: list[tuple]) -> list[tuple]:
    return [(f"{label}-clip", preset, {**fields, "max_grad_norm": CLIP}) for label, preset, fields in configs]


@pytest.fixture(scope="module")
def results(parity_runs):
    """Rank 0's run of every plan here (conftest.parity_runs: the same groups record the first
    steps the activation, comms and dry-run tests compare with)."""
    return parity_runs["runs"]


@pytest.mark.parametrize("label", list(ALL))
def test_parity(results, label):
    preset, fields = ALL[label]
    ref, got = W.reference(preset, fields, STEPS), results[label]  # computed once per reference plan
    dloss = max(abs(a - b) for a, b in zip(ref["losses"], got["losses"]))
    dgrad = W.max_diff(ref["grads"], got["grads"])
    dweight = W.max_diff(ref["weights"], got["weights"])
    print(f"{label}: dloss {dloss:.2e} dgrad {dgrad:.2e} dweight {dweight:.2e}")
    assert dloss <= LOSS_TOL, f"{label}: losses {got['losses']} vs {ref['losses']}"
    assert dgrad <= GRAD_TOL, f"{label}: max gradient difference {dgrad:.3e}"
    assert dweight <= WEIGHT_TOL, f"{label}: max weight difference {dweight:.3e}"


@pytest.mark.parametrize("label", list(ALL))
def test_parity_with_gradient_clipping(results, label):
    """Plan.max_grad_norm clips on the whole model's norm (every shard, axis and stage, a tied
    weight once) exactly as one process clips: the same norms, losses, gradients and weights."""
    preset, fields = ALL[label]
    ref = W.reference(preset, {**fields, "max_grad_norm": CLIP}, STEPS)
    got = results[f"{label}-clip"]
    assert all(n > CLIP for n in ref["grad_norms"]), ref["grad_norms"]  # every step clipped
    for a, b in zip(got["grad_norms"], ref["grad_norms"]):
        assert a == pytest.approx(b, rel=NORM_TOL), (label, got["grad_norms"], ref["grad_norms"])
    W.assert_parity(got, ref, (LOSS_TOL, GRAD_TOL, WEIGHT_TOL), label)


@pytest.mark.parametrize("label", [label for label, _, _ in BF16])
def test_parity_gathering_bf16(results, label):
    """bf16 as torchtitan runs it: FSDP gathers bf16 parameters and reduce-scatters fp32 gradients
    (the ledger says each collective's dtype), the fp32 master weights step, and losses, gradients
    and weights stay within verify()'s bf16 bound of one process cast the same way."""
    import torch

    from interactive_parallel.runtime.training.verify import TOLERANCE

    preset, fields = next((p, f) for lab, p, f in BF16 if lab == label)
    got, ref = results[label], W.reference(preset, fields, STEPS)
    tol = TOLERANCE["bf16"]
    W.assert_parity(got, ref, (tol["loss"], tol["grad"], tol["grad"]), label)
    dtypes = {(c.op, c.dtype) for c in got["comms"] if c.axis.startswith("fsdp")}
    assert ("all_gather", "bfloat16") in dtypes and ("reduce_scatter", "float32") in dtypes, dtypes
    assert ("all_gather", "float32") not in dtypes, dtypes
    assert all(w.dtype == torch.float32 for w in got["weights"].values()), "fp32 master weights"
    if fields.get("max_grad_norm"):
        for a, b in zip(got["grad_norms"], ref["grad_norms"]):
            assert a == pytest.approx(b, rel=tol["grad"]), (label, got["grad_norms"], ref["grad_norms"])


@pytest.mark.parametrize("label", [f"{label}-clip" for label in ALL] + [label for label, _, f in BF16 if f.get("max_grad_norm")])
def test_clip_all_reduces_equal_the_model(results, label):
    """The clipped runs' norm all-reduces on the ledger (rank 0, first step: calls, bytes per
    axis, fp32) are the ones plan.estimate.clip_comms predicts from the layout alone, and
    predict_comms counts them."""
    from interactive_parallel.plan import PRESETS, Plan
    from interactive_parallel.plan.estimate import clip_comms, predict_comms

    preset, fields = next((p, f) for lab, p, f in clipped(CONFIGS_2 + CONFIGS_4) + BF16 if lab == label)
    plan = Plan(**fields)
    clip = [c for c in results[label]["comms"] if c.module == "clip_grad_norm"]
    measured = {}
    for c in clip:
        n, b = measured.get((c.op, c.axis), (0, 0))
        measured[c.op, c.axis] = (n + 1, b + c.bytes)
    predicted = {(op, axis): (n, b) for op, axis, n, b in clip_comms(PRESETS[preset], plan, 0)}
    assert measured == predicted, (label, measured, predicted)
    assert {c.dtype for c in clip} <= {"float32"}, label
    unclipped = Plan(**{k: v for k, v in fields.items() if k != "max_grad_norm"})
    total = lambda p: {(e.op, e.axis): (e.count, e.bytes) for e in predict_comms(PRESETS[preset], p, 0)}  # noqa: E731
    with_clip, without = total(plan), total(unclipped)
    for key, (n, b) in predicted.items():
        before = without.get(key, (0, 0))  # the clip's all-reduces join the axis's others
        assert with_clip[key] == (before[0] + n, before[1] + b), key
