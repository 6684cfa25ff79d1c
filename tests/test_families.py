"""plan.models.FAMILIES against the transformers models they describe (built in this process).

A family entry is the one place that says where things live in a model and how it is
split; the runtime and the estimator only read it. Here, per family with a preset: every
module path resolves in the built model, the TP plan names known styles on declared
linears, and the estimator's inventory equals the model's own named_parameters() (names
and shapes: a tied head is the embedding, listed once).
"""
from __future__ import annotations

import pytest

from interactive_parallel.plan import FAMILIES, PRESETS
from interactive_parallel.plan.estimate import param_inventory
from interactive_parallel.plan.models import TP_STYLES

pytestmark = pytest.mark.rank1
SPECS = {spec.family: spec for spec in PRESETS.values()}


def test_every_family_has_a_preset_and_known_tp_styles():
    assert set(SPECS) == set(FAMILIES)
    for name, fam in FAMILIES.items():
        assert set(fam.tp_plan.values()) <= set(TP_STYLES), name
        assert set(fam.block_tp_styles()) <= set(fam.linears), name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_paths_resolve_and_inventory_matches_the_model(family):
    from interactive_parallel.runtime.model.models import build_model

    spec, fam = SPECS[family], FAMILIES[family]
    model = build_model(spec)
    for path in (*fam.embed_paths, *fam.head_paths):
        model.get_submodule(path)
    block = model.get_submodule(fam.layers_path)[0]
    for path in (fam.attention_path, fam.mlp_path, *fam.norm_paths, *fam.linears):
        block.get_submodule(path)
    for attr in fam.local_head_attrs:
        assert isinstance(getattr(block.get_submodule(fam.attention_path), attr), int), attr
    built = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {p.name: p.shape for p in param_inventory(spec)} == built
