"""What each plan does in the one-process mode (runtime.client.local) on this torch: every rank in
this process on LocalTensorMode, the mode's own refusals skipped, so a refused plan shows how it
fails. Prints one line per plan: OK with its first two losses and the wall time, or the failure's
type and message (quoted in docs/one-process.md and plan/local.py).

    PYTHONPATH=. flock /tmp/heavy.lock python bench/bench_local_mode.py
"""
from __future__ import annotations

import sys
import time

sys.path.insert(0, "tests")  # the tiny MoE specs of tests/moe_workers.py

PLANS = [
    ("tiny-llama", dict(tp=2)), ("tiny-llama", dict(tp=4, sequence_parallel=True)),
    ("tiny-llama", dict(tp=2, loss_parallel=True)), ("tiny-gpt2", dict(tp=2)),
    ("mixtral", dict(tp=2)), ("qwen3_moe", dict(tp=2)),
    ("tiny-llama", dict(dp=2)), ("tiny-llama", dict(fsdp=2)), ("tiny-llama", dict(dp=2, fsdp=2)),
    ("tiny-llama", dict(pp=2)), ("tiny-llama", dict(cp=2)), ("tiny-llama", dict(cp=2, cp_method="ring")),
    ("tiny-llama", dict(dp=2, tp=2)), ("mixtral", dict(dp=2, ep=2)),
]


def one(model: str, fields: dict) -> str:
    from interactive_parallel import Plan
    from interactive_parallel.plan import PRESETS
    from interactive_parallel.runtime.client.local import LocalRanks

    if model in PRESETS:
        spec = PRESETS[model]
    else:
        from moe_workers import spec_of

        spec = spec_of(model)
    t0 = time.perf_counter()
    try:
        ranks = LocalRanks(spec, Plan(**fields), checked=False)
        try:
            losses = [r.loss for r in ranks.train(2) if r.rank == 0]
        finally:
            ranks.close()
        return f"OK losses {losses[0]:.6f} {losses[1]:.6f} in {time.perf_counter() - t0:.1f} s"
    except Exception as e:  # noqa: BLE001 - the failure is the answer
        return f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:160]}"


if __name__ == "__main__":
    for model, fields in PLANS:
        print(f"{model:11s} {fields}: {one(model, fields)}", flush=True)
