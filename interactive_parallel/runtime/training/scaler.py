"""The fp16 gradient scaler for a rank with peers: torch's ShardedGradScaler, DTensor-aware.

Owns one thing: unscaling (and inf-checking) gradients that are DTensors, alone or mixed
with plain tensors. torch's ShardedGradScaler groups gradients by device and dtype only and
hands each group to one `torch._amp_foreach_non_finite_check_and_unscale_` call. Under our
plans a group can hold a DTensor gradient beside a plain one (tp leaves the norms plain, and
so does pp x tp), and DTensor's dispatch refuses that call ("got mixed torch.Tensor and
DTensor"), as it refused foreach AdamW (see runtime.training.train.make_optimizer). DTensors of
several meshes and no plain tensor (what fsdp x tp gives) pass in torch 2.13. Here each
DTensor gradient contributes its local tensor instead: unscaling is elementwise, so dividing
every shard (or partial sum) by the scale divides the DTensor, and an inf anywhere lands in
some rank's local tensor. Once unwrapped the gradients are plain tensors and the mesh no
longer matters, so the grouping stays torch's: device and dtype.

Everything else is torch's, unchanged: the per-device found-inf dict that `unscale_`, `step`
and `update` read, its all-reduce over the process group (the world, from make_scaler), so
an inf on one rank skips the step and backs off the scale on every rank; plain and sparse
gradients as torch treats them.

Knows nothing of plans, meshes or models: only the optimizer's parameters. Does not cover
optimizers that unscale inside their own step (`_step_supports_amp_scaling`, fused AdamW):
torch's ShardedGradScaler does not all-reduce their found-inf either, and make_optimizer
never builds one.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler, _GeneralMultiDeviceReplicator
from torch.distributed.tensor import DTensor


def _to_unscale(param: torch.Tensor, allow_fp16: bool) -> torch.Tensor:
    """The plain tensor whose values are param.grad's on this rank (may replace a sparse grad)."""
    grad = param.grad
    if (not allow_fp16) and grad.dtype == torch.float16:
        raise ValueError("Attempting to unscale FP16 gradients.")
    if isinstance(grad, DTensor):
        # Under no_grad to_local() is the DTensor's own local tensor, not a copy: the
        # in-place unscale below changes the DTensor gradient itself.
        return grad.to_local()
    if grad.is_sparse:
        # As torch: check the coalesced values (duplicates summed may overflow); fp16 cannot
        # coalesce, so it goes through fp32.
        if grad.dtype is torch.float16:
            param.grad = grad.type(torch.float32).coalesce().type(torch.float16)
        return param.grad._values()
    return grad


class DTensorGradScaler(ShardedGradScaler):
    """ShardedGradScaler whose unscale takes DTensor gradients by their local tensors."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
        per_device_inv_scale = _GeneralMultiDeviceReplicator(inv_scale)
        per_device_found_inf = _GeneralMultiDeviceReplicator(found_inf)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    t = _to_unscale(param, allow_fp16)
                    groups[(t.device, t.dtype)].append(t)
            for (device, _), grads in groups.items():
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, per_device_found_inf.get(device), per_device_inv_scale.get(device))
        # As torch: a rank with no gradients (an empty shard) still takes part in unscale_'s
        # all-reduce, or its peers would wait for it.
        if not per_device_found_inf._per_device_tensors:
            assert self._scale is not None
            per_device_found_inf.get(self._scale.device)
        return per_device_found_inf._per_device_tensors
