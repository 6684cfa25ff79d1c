"""Validation of a Plan against a rank count and a model spec: every problem at once, each naming its numbers.

Owns the rules (types, degrees and rank count, batch cuts, the combinations the runtime
composes, each pipeline schedule's microbatch and stage constraints, loss parallel and compile,
the model's divisibility and its experts) and `check`, which raises them as one PlanError.
Pure Python: knows no torch, no processes; every check here runs before any rank is touched.
Knows nothing of how a plan is laid out once valid (runtime/).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from .models import ModelSpec
from .plan import CP_METHODS, DEVICES, PRECISIONS, RECOMPUTES, SEED_LIMIT, Plan, PlanError
from .schedules import SCHEDULES, unknown_schedule


def validate(plan: Plan, world_size: int, spec: ModelSpec | None = None, *,
             cuda_available: int | None = None) -> list[str]:
    """Every problem with running `plan` on `world_size` ranks, each naming its numbers.

    `cuda_available` is the number of GPUs the ranks can see (None: unknown, not checked).
    """
    problems = _type_problems(plan)
    if problems:
        return problems
    # Messages name degrees in the order users write them, not the mesh's layout order.
    degrees = [(n, getattr(plan, n)) for n in ("dp", "fsdp", "tp", "pp", "cp")]
    for name, value in degrees + [("ep", plan.ep)]:
        if value < 1:
            problems.append(f"{name}({value}) must be a whole number >= 1")
    if problems:
        return problems
    used = [(n, v) for n, v in degrees if v > 1] or [("dp", 1)]
    if plan.world_size != world_size:
        product = " * ".join(f"{n}({v})" for n, v in used)
        problems.append(f"{product} = {plan.world_size} != ranks({world_size})")

    if plan.device not in DEVICES:
        problems.append(f"device {plan.device!r} is not one of {', '.join(DEVICES)}")
    elif plan.device == "cuda" and cuda_available is not None and cuda_available == 0:
        problems.append("device 'cuda' asked for, but torch sees no GPU on the ranks")
    if plan.precision not in PRECISIONS:
        problems.append(f"precision {plan.precision!r} is not one of {', '.join(PRECISIONS)}")
    elif plan.precision == "fp16" and plan.device != "cuda":
        problems.append("precision 'fp16' needs device 'cuda' (CPU autocast runs bf16)")
    if plan.pp_schedule not in SCHEDULES:
        problems.append(unknown_schedule(plan.pp_schedule))
    if plan.cp_method not in CP_METHODS:
        problems.append(f"cp_method {plan.cp_method!r} is not one of {', '.join(CP_METHODS)}")
    if not math.isfinite(plan.lr) or plan.lr <= 0:
        problems.append(f"lr({plan.lr}) must be a finite number > 0")
    if not math.isfinite(plan.max_grad_norm) or plan.max_grad_norm < 0:
        problems.append(f"max_grad_norm({plan.max_grad_norm}) must be a finite number >= 0 (0: no clipping)")
    if not 0 <= plan.seed < SEED_LIMIT:
        problems.append(f"seed({plan.seed}) must be in 0 .. 2**63 - 1")
    if plan.recompute not in RECOMPUTES:
        problems.append(f"recompute {plan.recompute!r} is not one of {', '.join(RECOMPUTES)}")

    problems += _batch_problems(plan)
    problems += _combination_problems(plan)
    if spec is not None:
        problems += _model_problems(plan, spec)
    return problems


def _type_problems(plan: Plan) -> list[str]:
    """Each field of the type its default has (an int field takes no bool or float, lr takes
    an int or a float): the value checks after this one compare numbers."""
    problems = []
    for f in dataclasses.fields(plan):
        value, kind = getattr(plan, f.name), type(f.default)
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            problems.append(f"{f.name}({value!r}) must be a {'whole number' if kind is int else kind.__name__}, "
                            f"not {type(value).__name__}")
    return problems


def _batch_problems(plan: Plan) -> list[str]:
    problems = []
    if plan.batch_size < 1:
        problems.append(f"batch_size({plan.batch_size}) must be >= 1")
    if plan.seq_len < 2:
        problems.append(f"seq_len({plan.seq_len}) must be >= 2 (one input and one target token)")
    if plan.grad_accum < 1:
        problems.append(f"grad_accum({plan.grad_accum}) must be >= 1")
    if plan.microbatches < 0:
        problems.append(f"microbatches({plan.microbatches}) must be >= 0")
    if plan.virtual_stages < 1:
        problems.append(f"virtual_stages({plan.virtual_stages}) must be >= 1")
    if problems:
        return problems
    split = plan.data_parallel * plan.grad_accum
    if plan.batch_size % split:
        problems.append(
            f"batch_size({plan.batch_size}) is not divisible by dp({plan.dp}) * fsdp({plan.fsdp}) * "
            f"grad_accum({plan.grad_accum}) = {split}")
    elif plan.pp > 1 and (plan.batch_size // split) % plan.n_microbatches:
        problems.append(
            f"per-rank micro-batch {plan.batch_size // split} is not divisible by "
            f"microbatches({plan.n_microbatches})")
    if plan.cp > 1 and plan.seq_len % (2 * plan.cp):
        problems.append(f"seq_len({plan.seq_len}) is not divisible by 2 * cp({plan.cp}) = {2 * plan.cp}")
    if plan.sequence_parallel and plan.tp > 1 and plan.seq_len % (plan.tp * plan.cp):
        what = f"tp({plan.tp}) * cp({plan.cp}) = {plan.tp * plan.cp}" if plan.cp > 1 else f"tp({plan.tp})"
        problems.append(f"seq_len({plan.seq_len}) is not divisible by {what} under sequence parallel")
    return problems


def _combination_problems(plan: Plan) -> list[str]:
    """Layouts the runtime cannot compose, and pipeline schedule limits."""
    problems = []
    if plan.ep > 1:
        if plan.data_ranks % plan.ep:
            problems.append(f"ep({plan.ep}) does not divide dp*fsdp*cp({plan.data_ranks}): expert parallelism rides on "
                            "the data-parallel ranks")
        if plan.max_grad_norm > 0:
            problems.append(f"max_grad_norm({plan.max_grad_norm}) with ep({plan.ep}) is not supported yet: each rank "
                            "holds its experts as plain tensors, whose norm the clip cannot tell from a replica's; "
                            "clip without ep, or train the experts unclipped (max_grad_norm=0)")
    if plan.cp > 1 and plan.pp > 1:
        problems.append(f"cp({plan.cp}) with pp({plan.pp}) is not supported: context-parallel attention "
                        "needs the position ids that pipeline stages do not pass on")
    problems += _schedule_problems(plan)
    problems += _loss_parallel_problems(plan)
    problems += _compile_problems(plan)
    return problems


def _schedule_problems(plan: Plan) -> list[str]:
    """The schedule's own microbatch and stage constraints (its record's rule, as torch's class
    checks it later, on the ranks), and stage_layers against the stages it lays out."""
    if plan.pp == 1:
        return []
    problems = []
    if plan.pp_schedule in SCHEDULES:
        problems += plan.schedule.problems(plan.pp, plan.n_microbatches, plan.virtual_stages)
    if plan.stage_layers:
        if len(plan.stage_layers) != plan.n_stages:
            problems.append(f"stage_layers has {len(plan.stage_layers)} entries for {plan.n_stages} pipeline stages")
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in plan.stage_layers):
            problems.append(f"stage_layers{tuple(plan.stage_layers)} must be whole numbers >= 1")
    return problems


def _loss_parallel_problems(plan: Plan) -> list[str]:
    if not plan.loss_parallel:
        return []
    if plan.tp == 1:
        return ["loss_parallel needs tp > 1 (tp(1)): it splits the embedding, the head and the loss "
                "over the tensor-parallel ranks"]
    if not plan.vocab_parallel:
        return ["loss_parallel needs vocab_parallel: the loss is taken on the head's vocabulary-split "
                "logits, and vocab_parallel=False keeps the head whole"]
    return []


def _compile_problems(plan: Plan) -> list[str]:
    """What compiled blocks (runtime.parallel.compile) cannot run under. Checked on CPU (inductor,
    gcc) at parity with one eager process: dp, fsdp, hsdp, tp (DTensor, with and without sequence
    parallel), pp (gpipe, 1f1b, interleaved), cp (in pieces around its collectives), recompute
    (in pieces around checkpoint's hooks) and MoE blocks without ep."""
    if not plan.compile:
        return []
    problems = []
    if plan.zero_bubble:
        problems.append(f"compile with pp_schedule {plan.pp_schedule!r}: torch's zero-bubble schedules cannot "
                        "split a compiled block's backward into its input and weight halves")
    if plan.ep > 1:
        problems.append(f"compile with ep({plan.ep}): the tokens each expert's rank receives change every step, "
                        "so the dispatch recompiles each step until torch's recompile limit (8) and then runs "
                        "eagerly, slower than never compiling")
    return problems


def _model_problems(plan: Plan, spec: ModelSpec) -> list[str]:
    problems = []
    if spec.max_positions and plan.seq_len > spec.max_positions:
        problems.append(f"seq_len({plan.seq_len}) > {spec.name} max positions({spec.max_positions})")
    if plan.tp > 1:
        for what, n in (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads),
                        ("intermediate_size", spec.intermediate_size), ("vocab_size", spec.vocab_size)):
            if what == "vocab_size" and not plan.vocab_split:
                continue  # the ends stay whole (vocab_parallel=False): nothing splits the vocabulary
            if n % plan.tp:
                why = " (the embedding and the head are split on it; vocab_parallel=False keeps them " \
                    "whole)" if what == "vocab_size" else ""
                problems.append(f"tp({plan.tp}) does not divide {what}({n}){why}")
    problems += _expert_problems(plan, spec)
    if plan.pp > 1:
        stages = plan.n_stages
        placed = SCHEDULES.get(plan.pp_schedule)
        what = (f"pp({plan.pp}) * virtual_stages({plan.virtual_stages}) = {stages}" if placed and placed.looped else
                f"2 * pp({plan.pp}) = {stages} ({plan.pp_schedule}'s V)" if placed and placed.v_shaped
                else f"pp({plan.pp})")
        if plan.stage_layers:
            if sum(plan.stage_layers) != spec.num_layers and len(plan.stage_layers) == stages:
                problems.append(f"stage_layers{tuple(plan.stage_layers)} sum to {sum(plan.stage_layers)} != "
                                f"num_hidden_layers({spec.num_layers})")
        elif spec.num_layers < stages:
            problems.append(f"num_hidden_layers({spec.num_layers}) < pipeline stages {what}")
        if placed and placed.v_shaped and spec.tied_embeddings and plan.data_parallel > 1:
            problems.append(f"pp_schedule {plan.pp_schedule!r} on {spec.name}'s tied embedding and head with "
                            f"dp({plan.dp}) * fsdp({plan.fsdp}) > 1: the V puts both ends on pipeline rank 0, one "
                            "weight in two data-parallel units (untie them, or take a looped schedule)")
    return problems


def _expert_problems(plan: Plan, spec: ModelSpec) -> list[str]:
    experts, top_k = spec.num_experts, spec.experts_per_token
    moe = spec.num_experts > 0 if spec.needs_facts else spec.family_info.experts is not None
    if not moe:
        return [f"ep({plan.ep}) asked for, but {spec.name} is a dense model (no experts to split)"] if plan.ep > 1 else []
    problems = []
    if top_k > experts:
        problems.append(f"num_experts_per_tok({top_k}) > num_experts({experts})")
    if plan.ep > 1 and experts % plan.ep:
        problems.append(f"ep({plan.ep}) does not divide num_experts({experts})")
    if plan.pp > 1 and spec.config.get("output_router_logits"):
        problems.append(f"pp({plan.pp}) with output_router_logits: the router loss is taken over every layer's "
                        "rows at once, and pipeline stages hold different layers (turn one of them off)")
    if plan.sequence_parallel and plan.tp > 1:
        problems.append(f"sequence_parallel with tp({plan.tp}) on {spec.name}'s expert layers is not laid out: "
                        "the experts take whole sequences (turn sequence_parallel off)")
    return problems


def check(plan: Plan, world_size: int, spec: ModelSpec | None = None, **kw: Any) -> Plan:
    """validate() that raises PlanError listing every problem."""
    problems = validate(plan, world_size, spec, **kw)
    if problems:
        raise PlanError(problems)
    return plan
