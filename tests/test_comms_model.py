"""The communication model (plan/estimate.predict_comms) against the comm ledger, call by call.

The oracle: every parity plan of tests/test_parallel_parity.py with tensor parallelism (both
families, every rank, fp32 and bf16 autocast) trains one step on spawned gloo ranks
(conftest.parity_steps, shared with the activation and dry-run tests); the ledger's tp
collectives on each rank (the all-reduces; the head's logits gather), calls and bytes per op, must
equal the prediction exactly: the dtype of each
(under autocast a rowwise output in bf16, an input gradient in fp32) included. Sequence
parallelism is left out: predict_comms counts its traffic as plain TP's (its docstring says so).
"""
from __future__ import annotations

import pytest

from conftest import PRECISIONS
from interactive_parallel import Plan
from interactive_parallel.plan import PRESETS
from interactive_parallel.plan.estimate import predict_comms

pytestmark = pytest.mark.multirank


def _tp_plans() -> list:
    from test_parallel_parity import ALL

    return [pytest.param(label, precision, id=f"{label}-{precision}") for label, (_, fields) in ALL.items()
            if fields.get("tp", 1) > 1 and not fields.get("sequence_parallel") for precision in PRECISIONS]


@pytest.mark.parametrize("label,precision", _tp_plans())
def test_tp_all_reduces_equal_the_ledger_call_by_call(parity_steps, label, precision):
    from test_parallel_parity import ALL

    preset, fields = ALL[label]
    plan = Plan(**fields, precision=precision)
    for rank, (_, comms, _) in parity_steps[label, precision].items():
        tp = [c for c in comms if c.axis == "tp"]
        measured = {op: (sum(1 for c in tp if c.op == op), sum(c.bytes for c in tp if c.op == op))
                    for op in sorted({c.op for c in tp})}
        predicted = {e.op: (e.count, e.bytes) for e in predict_comms(PRESETS[preset], plan, rank) if e.axis == "tp"}
        assert predicted == measured, (rank, predicted, measured)
        if precision == "bf16":  # what autocast leaves in fp32 is on the wire in fp32
            assert {c.dtype for c in tp} == {"bfloat16", "float32"}, rank
