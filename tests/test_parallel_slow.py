"""3-D parallelism on 8 ranks: dp2 x pp2 x tp2 at parity with one process (slow: 8 processes on a small host).

Same checks and tolerances as test_parallel_parity (loss 1e-5, gradients 1e-5, weights 1e-4).
"""
from __future__ import annotations

import pytest

from mp_harness import run_ranks
import parity_workers as W
from test_parallel_parity import GRAD_TOL, LOSS_TOL, STEPS, WEIGHT_TOL

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def test_dp2_pp2_tp2_parity():
    fields = dict(dp=2, pp=2, tp=2)
    got = run_ranks(W.parity_group, 8, [("3d", "tiny-llama", fields)], STEPS, timeout_s=420)[0]["3d"]
    ref = W.reference("tiny-llama", fields, STEPS)
    assert max(abs(a - b) for a, b in zip(ref["losses"], got["losses"])) <= LOSS_TOL
    assert W.max_diff(ref["grads"], got["grads"]) <= GRAD_TOL
    assert W.max_diff(ref["weights"], got["weights"]) <= WEIGHT_TOL
