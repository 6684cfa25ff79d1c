"""What inference needs to know before any rank runs: which serving engine runs under a plan,
which quantization a plan can hold, what is wrong with a list of requests, and a generator of
requests with staggered arrivals.

Owns those decisions and their reasons, each naming its numbers, so the client refuses bad
input before touching a rank and the README, the panel and the ranks give one answer.
Pure Python: knows the Plan, the model's FamilyInfo and the Request record, nothing of
torch, transformers objects or how a rank serves.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..records import Request
from .models import ModelSpec
from .plan import Plan

ENGINES = ("auto", "ours", "transformers")
"""'ours': this package's scheduler over transformers' caches (runs under every plan);
'transformers': its continuous-batching engine (ContinuousBatchingManager); 'auto' picks."""
POLICIES = ("continuous", "static")
"""'continuous': requests join and leave the running batch at every step; 'static': a batch
is formed only when the previous one has finished (the baseline continuous batching beats)."""

QUANT_SCHEMES: dict[str, str] = {
    "int8-weight-only": "torchao Int8WeightOnlyConfig: int8 weights with a scale per output channel, "
                        "dequantized into the fp32 matmul",
    "int8-dynamic": "torchao Int8DynamicActivationInt8WeightConfig: int8 weights, activations quantized "
                    "per token at run time, an int8 matmul",
    "int4-weight-only": "torchao IntxWeightOnlyConfig(int4, groups of 32): 16 levels per weight with a scale "
                        "per group; on CPU each value is stored in a byte (torchao's packed int4 kernels need "
                        "CUDA or mslk)",
}


def transformers_engine_problem(plan: Plan, spec: ModelSpec) -> str | None:
    """Why transformers' continuous-batching engine cannot serve under `plan` (None: it can)."""
    if plan.pp > 1:
        return f"pp({plan.pp}): its engine calls the whole model, whose stages live on different ranks"
    if plan.cp > 1:
        return (f"cp({plan.cp}): context-parallel attention is this package's own attention function, "
                "which the engine's paged attention would replace")
    if plan.fsdp > 1:
        return f"fsdp({plan.fsdp}): transformers refuses an FSDP mesh in continuous batching"
    if plan.ep > 1:
        return (f"ep({plan.ep}): every forward is an all-to-all over the ep group, whose ranks must then "
                "step together; the engine steps each replica on its own clock")
    if plan.tp > 1 and plan.sequence_parallel:
        return ("sequence parallel: the engine packs every request's tokens into one sequence, which "
                "sequence parallelism would have to cut evenly over tp ranks")
    if plan.tp > 1:
        keys = spec.family_info.tp_plan
        split_kv = all(any(k.endswith(f"layers.*.self_attn.{n}") for k in keys) for n in ("k_proj", "v_proj"))
        if not split_kv:
            return (f"tp({plan.tp}) on {spec.name}: the engine sizes its paged cache per TP rank only when "
                    "k_proj and v_proj are split (its own check); this family fuses q, k and v")
    return None


def serving_engine(plan: Plan, spec: ModelSpec, requests: Sequence[Any], engine: str = "auto",
                   policy: str = "continuous") -> tuple[str, str]:
    """(engine, why) for serving `requests` under `plan`; ValueError when `engine` cannot run."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    if engine == "ours":
        return "ours", "asked for"
    problem = transformers_engine_problem(plan, spec)
    if problem is None and policy == "static":
        problem = "policy 'static': the engine always batches continuously"
    if problem is None and any(getattr(r, "do_sample", False) for r in requests):
        problem = ("a request samples: the engine draws from one generator for all requests, so a "
                   "request's samples would depend on what it was batched with; ours gives each its own")
    if problem is None:
        return "transformers", f"transformers' ContinuousBatchingManager runs under plan {plan.describe()}"
    if engine == "transformers":
        raise ValueError(f"transformers' engine cannot serve here: {problem}")
    return "ours", f"transformers' engine cannot: {problem}"


def quantization_problems(plan: Plan, scheme: str, spec: ModelSpec) -> list[str]:
    """Why `scheme` cannot quantize `spec` laid out under `plan` (empty: it can)."""
    if scheme not in QUANT_SCHEMES:
        return [f"unknown quantization scheme {scheme!r}: one of {', '.join(QUANT_SCHEMES)}"]
    problems = []
    if spec.family_info.weights_transposed:
        problems.append(f"{spec.name}: its block linears are transformers' Conv1D (weights stored transposed), "
                        "which torchao's configs do not take; a Llama-family model can be quantized")
    if plan.fsdp > 1:
        problems.append(f"plan {plan.describe()}: FSDP gathers its own fp32 shards into the layers at every "
                        "forward, so quantized weights would be bypassed (measured); use dp, tp or pp")
    if scheme == "int8-dynamic" and plan.tp > 1:
        problems.append(f"plan {plan.describe()}: int8-dynamic's int8 matmul (aten._int_mm) has no DTensor "
                        "sharding rule, so it cannot run on tensor-parallel weights; int8-weight-only can")
    if scheme == "int4-weight-only" and plan.tp > 1:
        problems += _int4_groups_split(plan, spec)
    return problems


INT4_GROUP = 32
"""Input features per int4 scale (runtime.inference.quantize: torchao's PerGroup(32))."""


def _int4_groups_split(plan: Plan, spec: ModelSpec) -> list[str]:
    """int4 groups a weight's input features by INT4_GROUP; a rowwise linear holds its input features
    split over tp, and DTensor cannot view a split dimension as groups unless each rank holds whole
    groups, the same number each (measured: tiny-llama's o_proj under tp=4, 64 features in 4 slices
    of 16, raised in torchao's reshape on every rank)."""
    from .tp_styles import tp_style

    fam, narrow = spec.family_info, []
    for pattern, style in fam.tp_plan.items():
        block = pattern.split(".*.", 1)[-1]
        linear = fam.linears.get(block)
        if linear is not None and tp_style(style).shards == "input":
            width = spec.width(linear.in_width)
            if width % (INT4_GROUP * plan.tp):
                narrow.append(f"{block} ({width} input features: {width / plan.tp:g} a rank)")
    if not narrow:
        return []
    return [f"plan {plan.describe()}: int4-weight-only quantizes groups of {INT4_GROUP} input features, and under "
            f"tp({plan.tp}) a rowwise linear's slice holds no whole number of groups: {', '.join(narrow)}; "
            f"a smaller tp, or int8-weight-only, can"]


def request_problems(requests: Sequence[Any], spec: ModelSpec, *, max_batch: int = 8,
                     kv_tokens: int | None = None, lengths: Sequence[int] | None = None) -> list[str]:
    """Every problem with a serving call's requests and limits, each naming its numbers.
    `lengths`: each prompt's tokens under the model's tokenizer (None: the package's, one per
    character)."""
    problems: list[str] = []
    if not requests:
        return ["no requests given"]
    if not isinstance(max_batch, int) or max_batch < 1:
        problems.append(f"max_batch({max_batch}) must be >= 1")
    seen: dict[str, int] = {}
    for i, r in enumerate(requests):
        rid = getattr(r, "id", None)
        name = f"request {rid!r}" if rid is not None else f"request {i}"
        if not isinstance(rid, str) or not rid:
            problems.append(f"{name}: id must be a non-empty string")
        elif rid in seen:
            problems.append(f"duplicate request id {rid!r} (requests {seen[rid]} and {i})")
        else:
            seen[rid] = i
        n = lengths[i] if lengths is not None else len(r.prompt) if isinstance(r.prompt, str) else 0
        problems += [f"{name}: {p}" for p in _one_request_problems(r, spec, n)]
        need = n + r.max_new_tokens if isinstance(r.prompt, str) and isinstance(r.max_new_tokens, int) else 0
        if kv_tokens is not None and need > kv_tokens:
            problems.append(f"{name}: prompt({n}) + max_new_tokens({r.max_new_tokens}) = {need} > "
                            f"kv_tokens({kv_tokens}): it could never be admitted")
    return problems


def _one_request_problems(r: Any, spec: ModelSpec, n: int) -> list[str]:
    """`n`: the prompt's tokens."""
    out = []
    if not isinstance(r.prompt, str) or not r.prompt:
        out.append("prompt must be a non-empty string")
    if not isinstance(r.max_new_tokens, int) or isinstance(r.max_new_tokens, bool) or r.max_new_tokens < 1:
        out.append(f"max_new_tokens({r.max_new_tokens}) must be >= 1")
    elif isinstance(r.prompt, str) and n + r.max_new_tokens > spec.max_positions:
        out.append(f"prompt({n}) + max_new_tokens({r.max_new_tokens}) > "
                   f"{spec.name} max positions({spec.max_positions})")
    if not isinstance(r.arrival, (int, float)) or r.arrival < 0:
        out.append(f"arrival({r.arrival}) must be >= 0 seconds")
    if r.temperature <= 0:
        out.append(f"temperature({r.temperature}) must be > 0")
    if r.top_k < 0:
        out.append(f"top_k({r.top_k}) must be >= 0")
    if any(not isinstance(s, str) or not s for s in r.stop):
        out.append("stop strings must be non-empty strings")
    return out


EXAMPLE_PROMPTS = ("12+35=", "7+8=", "40+2=", "21+21=", "9+90=", "33+4=", "1+1=", "50+50=")
"""Prompts of the package's training task (two-digit additions)."""


def staggered_requests(n: int, gap_s: float = 0.05, max_new_tokens: int = 16,
                       prompts: Sequence[str] = EXAMPLE_PROMPTS, **sampling: Any) -> list[Request]:
    """`n` requests arriving one every `gap_s` seconds, cycling through `prompts`, each wanting
    between a quarter of `max_new_tokens` and all of it (mixed lengths, so batching has
    something to schedule); `sampling`: do_sample, temperature, top_k, stop, applied to each,
    with seeds 0, 1, 2, ..."""
    lengths = [max(1, max_new_tokens * k // 4) for k in (1, 4, 2, 3)]
    return [Request(id=f"r{i}", prompt=prompts[i % len(prompts)], arrival=round(i * gap_s, 6),
                    max_new_tokens=lengths[i % len(lengths)], seed=i, **sampling) for i in range(n)]
