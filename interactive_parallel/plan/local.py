"""Which plans the one-process mode (runtime.client.local: every rank in one process on torch's
LocalTensorMode) can run, decided once, and the refusal of the rest before anything is built.

Owns `local_problems(plan)`: every reason a plan cannot run in one process, each naming the
parallelism and what to use instead, and `check_local`, which raises them all at once as a
PlanError. What each refused parallelism does under LocalTensorMode on torch 2.13 (measured by
bench/bench_local_mode.py; its messages quoted in docs/one-process.md):
- dp (DDP): its constructor broadcasts the weights from storage it reads directly ("data is not
  allocated yet"), and each data-parallel rank trains on its own rows, which the mode's one
  Python thread of control cannot give each rank;
- fsdp / hsdp, and cp (its gradients are averaged by FSDP2's replicate): FSDP2 resizes the
  storage of its unsharded parameters, which a LocalTensor does not have ("resize_() on an
  invalid python storage");
- pp: stages are different programs on different ranks (MPMD), and the mode's send / recv need
  each rank to run its own thread ("'LocalTensor' object has no attribute '__src_rank__'");
- ring cp: the same send / recv; ep: transformers' expert all-to-all reads its split sizes as
  plain ints, which are one per rank here ("'LocalIntNode' object has no attribute 'has_hint'");
- compile, recomputation, fp16's scaler and CUDA: not tried under the mode: refused rather than
  trusted unchecked.
Tensor parallelism with or without sequence and loss parallelism (any model family, experts
included when they are not split) runs: every rank runs the same Python on the same batch.
Pure Python: no torch.
"""
from __future__ import annotations

from .models import ModelSpec
from .plan import Plan, PlanError

UNMATCHED_FAMILIES: tuple[str, ...] = ()
"""Families whose numbers under the mode were measured to differ from the reference: refused.
None now: GPT-2's were off after its first AdamW step until its nested gradients were flattened
(runtime.client.local.LocalRanks._unnest_grads; tests/test_local_mode.py holds it to parity)."""
SESSION = "the multi-process Session (Session(ranks=...))"
DRY_RUN = "a dry run (interactive_parallel.dry_run) for its layout, memory and communication"


def local_problems(plan: Plan, spec: ModelSpec | None = None) -> list[str]:
    """Every reason `plan` cannot run in the one-process mode ([] when it can)."""
    out = []
    alternative = f"use {SESSION}, or {DRY_RUN}"
    refused = (
        ("dp", plan.dp, "data parallel (DDP) gives each rank its own rows of the batch and broadcasts "
                        "weights from storage LocalTensorMode does not give"),
        ("fsdp", plan.fsdp, "FSDP2 resizes parameter storage, which LocalTensorMode's tensors do not have"),
        ("pp", plan.pp, "pipeline stages are different programs on different ranks, and their send / recv "
                        "need a thread per rank"),
        ("cp", plan.cp, "context parallel gives each rank its own part of the sequence and averages "
                        "gradients with FSDP2's replicate"),
        ("ep", plan.ep, "expert parallel's all-to-all reads its split sizes as plain numbers, one per rank here"),
    )
    for name, size, why in refused:
        if size > 1:
            out.append(f"{name}({size}): {why}; {alternative}")
    if plan.compile:
        out.append(f"compile=True: torch.compile is not tried under LocalTensorMode; use {SESSION}")
    if plan.recompute != "none":
        out.append(f"recompute={plan.recompute!r}: recomputation is not tried under LocalTensorMode; "
                   f"use {SESSION}, or recompute='none'")
    if plan.precision == "fp16":
        out.append(f"precision='fp16': the loss scaler is not tried under LocalTensorMode; use 'fp32' or "
                   f"'bf16', or {SESSION}")
    if spec is not None and spec.family in UNMATCHED_FAMILIES:
        out.append(f"model family {spec.family!r}: its weights after an optimizer step under this mode differ "
                   f"from the one-process reference's (measured on tiny-gpt2 under tp=2; not yet understood); "
                   f"use {SESSION}")
    if plan.device != "cpu":
        out.append(f"device={plan.device!r}: the one-process mode runs on the CPU; use {SESSION}")
    return out


def check_local(plan: Plan, spec: ModelSpec | None = None) -> None:
    """Raise PlanError naming every parallelism of `plan` the one-process mode cannot run."""
    problems = local_problems(plan, spec)
    if problems:
        raise PlanError([f"the one-process mode runs tensor parallel (tp, sequence_parallel, "
                         f"loss_parallel) only: {plan.describe()} cannot run here"] + problems)


__all__ = ["check_local", "local_problems"]
