"""The CUDA path, as far as a CPU shows it: no GPU runs here (bench/gpu_check.py is the GPU check).

- every tensor handed to a collective is on the group's device: the runtime's own tensors
  built without a device are put on meta and the collective device check must stay quiet
  through train, verify, generate, stop agreement, the doctor and a re-plan through DCP (the check
  itself is shown to catch what runtime/training/verify.py's global_loss used to do);
- pipeline + fp16: the schedule's loss is scaled before the scaler unscales (gradients after
  unscale_ equal those without a scaler), and fp16 under pp=2 matches one process;
- the optimizer settings of a GPU run (foreach, one group per parameter kind) run every
  layout at parity with the CPU settings.
"""
from __future__ import annotations

import pytest

import device_workers as W
from mp_harness import run_ranks

pytestmark = pytest.mark.multirank

SMALL = dict(batch_size=8, seq_len=32)


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), f"names differ: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_every_collective_gets_a_tensor_on_the_group_device():
    plans = [dict(dp=2), dict(tp=2), dict(pp=2, microbatches=2)]
    out = run_ranks(W.every_collective_on_the_group_device, 2, plans)[0]
    assert "all_reduce was handed a tensor on meta" in out.pop("control")
    assert set(out) == {"dp2", "tp2", "pp2"}, out
    for plan, ran in out.items():
        names = dict(ran)
        assert list(names) == ["train", "global_loss", "verify", "generate", "agree_stop", "doctor", "carry"]
        assert names["verify"] is True and names["doctor"] == "" and names["agree_stop"] is False, (plan, ran)
        assert 0 < names["global_loss"] < 10 and len(names["generate"][0]) == 2, (plan, ran)
    assert all(dict(ran)["carry"] == "carried" for ran in out.values())  # weights and AdamW state through DCP


def test_pipeline_scales_the_loss_it_unscales():
    out = run_ranks(W.pipeline_scaling, 2)[0]
    assert abs(out["scaled_loss"] - out["loss"]) <= 1e-6  # the reported loss is the unscaled one
    # 1024 is a power of two: scaling and unscaling are exact in fp32
    assert max_diff(out["plain"], out["unscaled"]) <= 1e-7


def test_fp16_under_a_pipeline_matches_one_process():
    """fp16 autocast and a dynamic scaler (CPU autocast runs fp16 too); tolerance: verify's fp16."""
    from interactive_parallel.runtime.training.verify import TOLERANCE

    fields = dict(pp=2, microbatches=2, precision="fp16", **SMALL)
    par = run_ranks(W.train_losses, 2, "tiny-llama", fields, 3)[0]
    ref = W.train_losses(0, "tiny-llama", dict(precision="fp16", **SMALL), 3)
    assert par["scaler"] == "DTensorGradScaler" and ref["scaler"] == "GradScaler"  # runtime/training/scaler.py: torch's ShardedGradScaler, DTensor-aware
    assert par["scale"] == ref["scale"]  # the same steps were skipped (or none) on both
    tol = TOLERANCE["fp16"]["loss"]
    assert max(abs(a - b) for a, b in zip(par["losses"], ref["losses"])) <= tol, (par["losses"], ref["losses"])
    assert max_diff(par["weights"], ref["weights"]) <= tol


def test_gpu_optimizer_settings_run_every_layout_at_parity():
    configs = [("tp2", dict(tp=2, **SMALL)), ("pp2", dict(pp=2, microbatches=2, **SMALL)),
               ("fsdp2", dict(fsdp=2, **SMALL)), ("dp2", dict(dp=2, **SMALL))]
    out = run_ranks(W.optimizer_settings, 2, configs, 3)[0]
    for label, (cpu, gpu) in out.items():
        assert cpu["groups"] == 1, label
        # fp32: the multi-tensor kernels do the same arithmetic as the per-tensor loop
        assert max(abs(a - b) for a, b in zip(cpu["losses"], gpu["losses"])) <= 1e-6, label
        assert max_diff(cpu["weights"], gpu["weights"]) <= 1e-6, label
    assert out["tp2"][1]["groups"] == 2  # plain norms and DTensor weights: one foreach call each
