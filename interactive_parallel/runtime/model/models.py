"""Build a transformers causal LM from a ModelSpec: on the meta device, or whole.

Owns turning a spec (preset config dict or local directory) into an nn.Module. The
runtime builds on the meta device (`build_meta`: no storage at all) and lets
runtime.layout.parallelize materialize each rank's shards (runtime.layout.initialize fills them);
`build_model` is the whole model with transformers' own initialization or weights, for
code that wants a plain model in this process (tests, the exported directory of a test
model). Knows nothing of meshes or parallel styles, nor of where things live inside
the model (plan.models.FAMILIES says that).
"""
from __future__ import annotations

import torch
from torch import nn

from ...plan.models import ModelSpec


def make_config(spec: ModelSpec):
    from transformers import AutoConfig

    kwargs = dict(spec.config)
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    # SDPA on CPU is exact enough for parity and is what users run; eager is the fallback
    # for code paths (ring attention) that need the raw scores.
    config._attn_implementation = "sdpa"
    return config


def build_meta(spec: ModelSpec) -> nn.Module:
    """The model's modules with every parameter and buffer on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(spec), dtype=torch.float32)
    model.config.use_cache = False
    return model


def build_model(spec: ModelSpec, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """The full model in fp32 on `device`; random init from `seed` unless the spec has weights."""
    from transformers import AutoModelForCausalLM

    if spec.has_weights:
        model = AutoModelForCausalLM.from_pretrained(spec.source, dtype=torch.float32,
                                                     local_files_only=True)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(make_config(spec), dtype=torch.float32)
    model.config.use_cache = False
    return model.to(device)
