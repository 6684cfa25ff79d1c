"""Quantization of the laid-out model with torchao, measured, and the way back to full precision.

Owns which weights are quantized (the linears of the decoder blocks this rank holds, from
the family's FamilyInfo.linears; embeddings, norms and the LM head stay fp32), applying
torchao's config to them in place (`quantize_`, the successor torch points to for
`torch.ao.quantization`), the byte count of what the forward now uses (a torchao tensor
counts its inner tensors, a DTensor its local part), the probe that measures decoding speed
and agreement of greedy tokens before and after, and the full-precision weights kept aside
so that apply / load / dequantize put exactly them back. Which plans and models it runs
under is decided before any rank is touched (plan/inference.quantization_problems): under
TP torchao's tensors wrap the DTensor shards and compose with them (int8 weight-only and
int4 measured); FSDP re-gathers its own fp32 shards at every forward, so it is refused.
Knows nothing of the client or of training (api.train refuses a quantized model).
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from ...records import QuantizeRecord
from ..layout.parallelized import Parallelized
from .generate import generate_ids

PROBE_PROMPTS = ["12+35=", "7+8=", "40+2=", "99+1="]
PROBE_TOKENS = 32


def config(scheme: str):
    """torchao's config object for a scheme name (plan/inference.QUANT_SCHEMES)."""
    from torchao.quantization import (Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig,
                                      IntxWeightOnlyConfig)
    from torchao.quantization.granularity import PerGroup

    if scheme == "int8-weight-only":
        return Int8WeightOnlyConfig()
    if scheme == "int8-dynamic":
        return Int8DynamicActivationInt8WeightConfig()
    if scheme == "int4-weight-only":
        # Int4WeightOnlyConfig needs mslk or CUDA here (without them: ImportError / "Torch not
        # compiled with CUDA"); the intx workflow runs int4 values with a scale per group of 32 on CPU.
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    raise ValueError(f"unknown quantization scheme {scheme!r}")


def target_paths(par: Parallelized) -> list[str]:
    """Module paths of the block linears this rank holds."""
    fam = par.spec.family_info
    layers = [i for s in par.stages for i in s.layer_ids] if par.stages else range(par.spec.num_layers)
    return [f"{fam.layers_path}.{i}.{path}" for i in layers for path in fam.linears]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds on this rank: a DTensor's local part, a subclass's inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if hasattr(t, "to_local"):
        return tensor_bytes(t.to_local())
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def param_bytes(par: Parallelized) -> int:
    """Bytes of the parameters the forward uses on this rank (each one once)."""
    seen, total = set(), 0
    for p in par.raw.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += tensor_bytes(p)
    return total


def probe(par: Parallelized) -> tuple[torch.Tensor, float]:
    """(greedy token ids of the probe prompts, tokens per second) on the current weights."""
    t0 = time.perf_counter()
    ids = generate_ids(par, PROBE_PROMPTS, PROBE_TOKENS)
    return ids, ids.numel() / (time.perf_counter() - t0)


def quantize(par: Parallelized, scheme: str, rank: int) -> tuple[QuantizeRecord, dict[str, Any]]:
    """Quantize this rank's block linears in place: (what it measured, the full-precision weights
    kept aside, for `restore`)."""
    from torchao.quantization import quantize_

    paths = set(target_paths(par))
    before_bytes = param_bytes(par)
    ids_before, speed_before = probe(par)
    kept = {path: par.raw.get_submodule(path).weight for path in paths}
    quantize_(par.raw, config(scheme), filter_fn=lambda module, fqn: fqn in paths and isinstance(module, nn.Linear))
    ids_after, speed_after = probe(par)
    agreement = float((ids_before == ids_after).float().mean()) if ids_before.numel() else 1.0
    record = QuantizeRecord(rank=rank, scheme=scheme, plan=par.plan.describe(), linears=len(paths),
                            params_before=before_bytes, params_after=param_bytes(par),
                            kept_bytes=sum(tensor_bytes(w) for w in kept.values()),
                            tokens_per_s_before=speed_before, tokens_per_s_after=speed_after, agreement=agreement,
                            probe=f"{len(PROBE_PROMPTS)} prompts x {PROBE_TOKENS} greedy tokens")
    return record, kept


def restore(par: Parallelized, kept: dict[str, Any]) -> None:
    """Put the full-precision weights `quantize` kept back into their linears."""
    for path, weight in kept.items():
        par.raw.get_submodule(path).weight = weight


def dequantize(st) -> bool:
    """Put back the full-precision weights a rank's RankState holds for its quantized model
    (runtime.rank.state.Quantized); False when the model was not quantized (or has no layout)."""
    held, st.quantized = st.quantized, None
    if held is None or st.parallel is None:
        return False
    restore(st.parallel, held.full)
    return True
