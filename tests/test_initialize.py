"""Weights of a model built on the meta device: seeded tiles, the model's own rules, local files.

- A seeded fill depends on the logical position only: the whole tensor, its row blocks, its
  column blocks and permuted column runs (as GPT-2's fused q|k|v holds them under TP) give
  the same values, drawn one tile at a time.
- The distributions are the model's own `_init_weights` (transformers' from_config in this
  process): norms and biases equal exactly, random weights have its standard deviation
  (within STD_TOL relative; GPT-2's residual projections scaled by 1/sqrt(2 x layers)), an
  embedding's padding row is zero, a tied head is the embedding.
- A local model directory is read slice by slice: the laid-out weights equal the files'.
"""
from __future__ import annotations

import pytest
import torch

from interactive_parallel.plan import PRESETS, Plan
from interactive_parallel.runtime.layout.initialize import TILE, fill_normal
from interactive_parallel.runtime.layout.pieces import Piece, pieces

STD_TOL = 0.1


def _filled(shape, parts):
    out = torch.full(shape, float("nan"))
    for offsets, sizes in parts:
        view = out[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        fill_normal(Piece(tuple(offsets), view), shape, 0.02, seed=5, name="w")
    return out


@pytest.mark.rank1
def test_seeded_fill_is_the_same_however_the_tensor_is_cut():
    shape = (TILE[0] * 2 + 7, TILE[1] + 300)
    whole = _filled(shape, [((0, 0), shape)])
    rows = _filled(shape, [((0, 0), (100, shape[1])), ((100, 0), (shape[0] - 100, shape[1]))])
    cols = _filled(shape, [((0, 0), (shape[0], 1000)), ((0, 1000), (shape[0], shape[1] - 1000))])
    assert not whole.isnan().any() and torch.equal(whole, rows) and torch.equal(whole, cols)
    vector = _filled((5000,), [((0,), (5000,))])
    assert torch.equal(vector, _filled((5000,), [((0,), (1234,)), ((1234,), (3766,))]))


@pytest.mark.rank1
def test_pieces_of_a_permuted_tensor_are_logical_runs():
    perm = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])  # [q0 k0 | q1 k1] as tp=2 stores [q | k] of width 4
    local = torch.arange(16.0).view(2, 8)
    got = pieces(local, (1, perm))
    assert [(p.offsets, p.sizes) for p in got] == [((0, 0), (2, 2)), ((0, 4), (2, 2)), ((0, 2), (2, 2)),
                                                     ((0, 6), (2, 2))]
    assert torch.equal(got[1].view, local[:, 2:4])


@pytest.mark.rank1
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_rules_are_the_models_own(preset):
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.model.models import build_model

    spec = PRESETS[preset]
    theirs = dict(build_model(spec, seed=1).named_parameters())
    ours = parallelize(spec, Plan()).raw
    mine = dict(ours.named_parameters())
    assert set(mine) == set(theirs)
    for name, t in theirs.items():
        m, t = mine[name].detach(), t.detach()
        if t.std() == 0:
            assert torch.equal(m, t), name
        else:
            assert abs(float(m.std()) / float(t.std()) - 1) < STD_TOL, (name, float(m.std()), float(t.std()))
        zero_rows = (t == 0).all(dim=-1) if t.dim() == 2 else None
        if zero_rows is not None and zero_rows.any():
            assert (m[zero_rows] == 0).all(), name  # the padding row
    if spec.tied_embeddings:
        assert ours.lm_head.weight is ours.get_input_embeddings().weight
    if preset == "tiny-gpt2":
        scaled = float(mine["transformer.h.0.mlp.c_proj.weight"].detach().std())
        assert abs(scaled / (0.02 / (2 * spec.num_layers) ** 0.5) - 1) < STD_TOL


@pytest.mark.rank1
def test_buffers_are_recomputed():
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.model.models import build_model

    spec = PRESETS["tiny-llama"]
    theirs = dict(build_model(spec).named_buffers())
    ours = dict(parallelize(spec, Plan()).raw.named_buffers())
    assert theirs and all(torch.equal(ours[n], b) for n, b in theirs.items())


@pytest.mark.multirank
def test_local_directory_is_read_slice_by_slice(tmp_path):
    from interactive_parallel.runtime.model.models import build_model
    from mp_harness import run_ranks
    import state_workers as S

    spec = PRESETS["tiny-gpt2"]
    saved = build_model(spec, seed=7)
    saved.save_pretrained(tmp_path / "gpt2")
    expected = saved.state_dict()
    got = run_ranks(S.weights_from_directory, 2, str(tmp_path / "gpt2"), [dict(tp=2), dict(fsdp=2), dict(pp=2)])[0]
    for label, weights in got.items():
        assert set(weights) <= set(expected)
        assert all(torch.equal(weights[k], expected[k]) for k in weights), label


@pytest.mark.rank1
def test_the_layout_can_stay_on_the_meta_device():
    """parallelize(materialize=False): the plan's modules with no storage at all (a dry run's input)."""
    from interactive_parallel.plan.estimate import param_inventory
    from interactive_parallel.runtime.layout.parallelize import parallelize

    import dataclasses

    base = PRESETS["tiny-llama"]
    spec = dataclasses.replace(base, config=dict(base.config, hidden_size=4096, intermediate_size=14336,
                                                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8))
    par = parallelize(spec, Plan(), materialize=False)
    params = dict(par.raw.named_parameters())
    assert all(p.is_meta for p in params.values())
    assert {p.name: p.shape for p in param_inventory(spec)} == {n: tuple(p.shape) for n, p in params.items()}


@pytest.mark.multirank
def test_full_weights_given_in_process_are_cut_into_shards(tmp_path):
    """parallelize(state_dict=...) (notebooks hand it rank-side full weights): each rank keeps its pieces."""
    from mp_harness import run_ranks
    import state_workers as S

    got = run_ranks(S.weights_from_full_state, 2, "tiny-gpt2", [dict(tp=2), dict(fsdp=2), dict(pp=2)])[0]
    assert got and all(got.values()), got
