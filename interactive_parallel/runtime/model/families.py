"""A model family's facts derived from transformers itself, for any decoder whose config ships
a TP and a PP plan.

Owns `derive(spec) -> FamilyInfo` and `with_facts(spec)`: the plain data plan/ reads
(plan.facts.FamilyInfo), taken from three places and never from the family's name:
- the config class's `base_model_tp_plan` (module pattern -> transformers' style name,
  kept as it is where plan.tp_styles has its record) and `base_model_pp_plan` (which
  modules run before, around and after the block list), and for a mixture of experts its
  `base_model_ep_plan` (which module holds the stacked experts: ExpertsInfo; the TP plan's
  expert entries are dropped, the experts stay whole under tp);
- the model built on the meta device (no storage): module paths, every block linear's
  shape and bias, the norms and what else a block holds, the LM head, the rotary table,
  how a block hands attention its input (read from the block's own source);
- a small copy of the config (a few heads, two blocks, a short window) built whole on the
  CPU: what `_init_weights` gives a norm, what the base model's forward multiplies the
  embeddings by, and a check that the stage forward the pipeline and context parallel run
  (runtime.model.stage.StageModule, driven by these facts) gives the model's own logits.
  A family whose forward does something the facts do not say is refused there, with the
  difference named, rather than trained wrong.

Refusals are UnknownModelError, raised before any rank builds anything: a config transformers
refuses or whose model's forward fails on the meta device (every spec is checked so, the
hand-written families' too), a model type without the plans, a TP style not mapped here,
blocks that differ (dense and sparse mixed), an EP style not mapped, a stage forward the facts do not reproduce.
Derivations are cached per config. The reading is runtime.model.family_facts's, the check on
the small copy runtime.model.family_check's; this module owns the two entry points, the cache
and the shape check every spec takes. Importing this module costs nothing: torch and
transformers load when a spec is first checked (a client that only plans presets never
loads them). Knows nothing of plans, meshes or ranks.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from ...plan.models import FamilyInfo, ModelSpec, resolve_model
from .family_check import checked
from .family_facts import derive_unchecked, forward_on_meta, meta_model


def resolved(model: Any) -> ModelSpec:
    """plan.resolve_model(model), checked by transformers and with its family facts."""
    return with_facts(resolve_model(model))


def with_facts(spec: ModelSpec) -> ModelSpec:
    """`spec` with its family facts, derived when FAMILIES does not hold them; its config first
    built by transformers whatever the family, so one transformers refuses is refused here."""
    if spec.needs_facts:
        return dataclasses.replace(spec, facts=derive(spec))  # the derivation checks the shapes too
    _shapes_checked(json.dumps(spec.config, sort_keys=True, default=str), spec.name)
    return spec


@functools.lru_cache(maxsize=32)
def _shapes_checked(config_json: str, name: str) -> None:
    """A hand-written family's config built by transformers and its shapes checked (forward_on_meta)."""
    forward_on_meta(meta_model(json.loads(config_json), name), name)


def derive(spec: ModelSpec) -> FamilyInfo:
    return _derive(json.dumps(spec.config, sort_keys=True, default=str), spec.name)


@functools.lru_cache(maxsize=32)
def _derive(config_json: str, name: str) -> FamilyInfo:
    config = json.loads(config_json)
    return checked(config, name, derive_unchecked(config, name))

