"""The communication model (plan/estimate.predict_comms) against the comm ledger, call by call.

The oracle: every parity plan of tests/test_parallel_parity.py with tensor parallelism (both
families, every rank, fp32 and bf16 autocast) trains one step on spawned gloo ranks
(conftest.parity_steps, shared with the activation and dry-run tests); the ledger's tp
collectives on each rank (the all-reduces; the head's logits gather), calls and bytes per op, must
equal the prediction exactly: the dtype of each
(under autocast a rowwise output in bf16, an input gradient in fp32) included. Sequence
parallelism is left out: predict_comms counts its traffic as plain TP's (its docstring says so).
FSDP's gathers and reduce-scatters are held the same way on every FSDP parity plan, pipelined ones
included (a unit gathered once per micro-step there, kept until the last backward).
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
            # FSDP's bf16 units compute in bf16: only loss parallel's per-token fp32 values stay
            fp32 = not plan.gathers_bf16 or plan.loss_parallel
            assert {c.dtype for c in tp} == ({"bfloat16", "float32"} if fp32 else {"bfloat16"}), rank


def _fsdp_plans() -> list:
    from test_parallel_parity import ALL

    return [pytest.param(label, precision, id=f"{label}-{precision}") for label, (_, fields) in ALL.items()
            if fields.get("fsdp", 1) > 1 for precision in PRECISIONS]


@pytest.mark.parametrize("label,precision", _fsdp_plans())
def test_fsdp_gathers_and_reduce_scatters_equal_the_ledger(parity_steps, label, precision):
    """Calls, bytes and dtypes: under bf16 FSDP gathers bf16 parameters (half the fp32 bytes) and
    reduce-scatters fp32 gradients (fsdp.mixed_precision), as the model counts; under a pipeline
    every stage module is a unit of its own and each unit is gathered once per micro-step."""
    from test_parallel_parity import ALL

    preset, fields = ALL[label]
    plan = Plan(**fields, precision=precision)
    for rank, (_, comms, _) in parity_steps[label, precision].items():
        measured = {}
        for c in comms:
            if c.op in ("all_gather", "reduce_scatter") and c.axis.startswith("fsdp"):
                n, b, dtypes = measured.get(c.op, (0, 0, set()))
                measured[c.op] = (n + 1, b + c.bytes, dtypes | {c.dtype})
        predicted = {e.op: (e.count, e.bytes) for e in predict_comms(PRESETS[preset], plan, rank)
                     if e.op in ("all_gather", "reduce_scatter") and e.axis.startswith("fsdp")}
        assert {op: (n, b) for op, (n, b, _) in measured.items()} == predicted, (rank, measured, predicted)
        gathered = "bfloat16" if precision == "bf16" else "float32"
        assert measured["all_gather"][2] == {gathered} and measured["reduce_scatter"][2] == {"float32"}, measured
