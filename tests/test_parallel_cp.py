"""Context-parallel attention on its own: output, dQ, dK and dV against causal SDPA on one process.

dK and dV are the gradients that cross ranks (each rank's keys serve every later query),
so they are the ones a wrong all-gather backward gets wrong while dQ stays right.
Tolerance CP_TOL = 1e-5 absolute. Also the load-balanced split itself (pure).
"""
from __future__ import annotations

import pytest
import torch

from mp_harness import run_ranks
import parity_workers as W
from interactive_parallel.runtime.parallel.cp import local_positions, shard_sequence

CP_TOL = 1e-5
SHAPE = (2, 4, 16, 8)  # batch, heads, sequence, head dim


@pytest.mark.pure
def test_load_balanced_split_pairs_early_and_late_chunks():
    t = torch.arange(16).view(1, 16)
    assert shard_sequence(t, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(t, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert local_positions(8, 2, 1, "cpu").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.multirank
def test_cp_attention_output_and_gradients():
    cp = 2
    got = run_ranks(W.cp_attention_grads, cp, SHAPE, cp)
    ref = W.cp_attention_reference(SHAPE)
    for key, dim in (("out", 1), ("dq", 2), ("dk", 2), ("dv", 2)):
        for rank in range(cp):
            want = shard_sequence(ref[key], cp, rank, dim=dim)
            diff = float((got[rank][key] - want).abs().max())
            assert diff <= CP_TOL, f"{key} on rank {rank}: max difference {diff:.2e}"
