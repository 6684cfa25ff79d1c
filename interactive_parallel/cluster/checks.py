"""The client's refusals of bad input, before any rank is touched.

Owns every check that needs only the input and what the client already knows (the session's
device and size, the loaded model's spec, the applied plan, the quantization scheme): a plan
for this session, debug mode under DDP, prompts, serving requests, a fault to inject, the
whole numbers of a training call. Each returns the checked value or raises one exception
listing every problem with its numbers; pure, so each is tested on inputs alone
(tests/test_checks.py). Knows nothing of ranks, pools or torch; memory admission, which asks
the ranks what is free, lives with the model operations (cluster/model_ops.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ..plan import ModelSpec, Plan, PlanError, check
from ..plan.inference import quantization_problems, request_problems
from ..plan.plan import DEVICES
from ..records import FaultSpec, Request
from .errors import SessionError
from .pool import LAUNCHES


def whole(value: Any) -> bool:
    """A whole number >= 0 (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_plan(plan: Plan, device: str, world_size: int, spec: ModelSpec | None) -> Plan:
    """The plan as a session of `world_size` ranks on `device` would run it, or PlanError."""
    problems = []
    if plan.device != device:
        problems.append(f"plan device {plan.device!r} != session device {device!r}")
    try:
        check(plan, world_size, spec)
    except PlanError as exc:
        problems = exc.problems + problems
    if problems:
        raise PlanError(problems)
    return plan


def check_debug_plan(plan: Plan | None, debugging: bool) -> None:
    """DDP segfaults the engines when its group is a DETAIL debug wrapper (torch 2.13 CPU:
    constructing DistributedDataParallel dies with SIGSEGV); refuse it here."""
    if plan is not None and debugging and plan.uses_ddp:
        raise SessionError(f"debug mode cannot run plan {plan.describe()}: DDP crashes under "
                           "TORCH_DISTRIBUTED_DEBUG=DETAIL on this torch; use Plan(fsdp=...) "
                           "(or dp combined with another axis) while debugging")


def check_counts(**counts: Any) -> None:
    """Each named count a whole number >= 0, or PlanError naming every one that is not."""
    problems = [f"{name}({value!r}) must be a whole number >= 0" for name, value in counts.items() if not whole(value)]
    if problems:
        raise PlanError(problems)


def check_prompts(prompts: list, max_new_tokens: Any, temperature: float, top_k: int, spec: ModelSpec) -> None:
    problems = []
    if not prompts:
        problems.append("no prompts given")
    if any(not isinstance(p, str) or not p for p in prompts):
        problems.append("every prompt must be a non-empty string")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        problems.append(f"max_new_tokens({max_new_tokens}) must be >= 1")
    elif prompts and all(isinstance(p, str) for p in prompts):
        longest = max(len(p) for p in prompts)  # one token per character
        if longest + max_new_tokens > spec.max_positions:
            problems.append(f"longest prompt({longest}) + max_new_tokens({max_new_tokens}) > "
                            f"{spec.name} max positions({spec.max_positions})")
    if temperature <= 0:
        problems.append(f"temperature({temperature}) must be > 0")
    if top_k < 0:
        problems.append(f"top_k({top_k}) must be >= 0")
    if problems:
        raise ValueError("; ".join(problems))


def check_quantization(scheme: str, plan: Plan, spec: ModelSpec) -> None:
    problems = quantization_problems(plan, scheme, spec)
    if problems:
        raise ValueError("; ".join(problems))


def refuse_quantized(scheme: str | None, what: str) -> None:
    if scheme is not None:
        raise SessionError(f"the model is quantized ({scheme}): {what} needs full-precision "
                           "weights; call dequantize() (or apply a plan, or load a checkpoint) first")


def check_requests(requests: Any, spec: ModelSpec, max_batch: int, kv_tokens: int | None) -> list[Request]:
    """Request objects (from Requests, dicts, or bare prompt strings), or ValueError listing
    every problem."""
    items = [requests] if isinstance(requests, (str, Request, dict)) else list(requests)
    reqs = []
    for i, r in enumerate(items):
        if isinstance(r, str):
            r = Request(id=str(i), prompt=r)
        elif isinstance(r, dict):
            r = Request(**r)
        elif not isinstance(r, Request):
            raise TypeError(f"request {i} is a {type(r).__name__}: give Request objects, dicts or prompts")
        reqs.append(dataclasses.replace(r, stop=list(r.stop)))
    problems = request_problems(reqs, spec, max_batch=max_batch, kv_tokens=kv_tokens)
    if problems:
        raise ValueError("bad requests:\n  - " + "\n  - ".join(problems))
    return reqs


def check_fault(fault: FaultSpec, world_size: int, kinds: Sequence[str], places: Sequence[str]) -> FaultSpec:
    """A fault that can be armed on a session of `world_size` ranks, or ValueError naming every problem."""
    problems = []
    if not whole(fault.rank) or not fault.rank < world_size:
        problems.append(f"rank({fault.rank!r}) is not one of 0..{world_size - 1}")
    if fault.fault not in kinds:
        problems.append(f"fault {fault.fault!r} is not one of {', '.join(kinds)}")
    if fault.where not in places:
        problems.append(f"where {fault.where!r} is not one of {', '.join(places)}")
    if not whole(fault.at_step):
        problems.append(f"at_step({fault.at_step!r}) must be a whole number >= 0")
    if not whole(fault.collective):
        problems.append(f"collective({fault.collective!r}) must be a whole number >= 0")
    if not isinstance(fault.seconds, (int, float)) or isinstance(fault.seconds, bool) or fault.seconds < 0:
        problems.append(f"seconds({fault.seconds!r}) must be a number >= 0")
    if problems:
        raise ValueError("; ".join(problems))
    return fault


def check_session_args(ranks: Any, device: Any, interface: Any, snapshot_every: Any, launch: Any = None) -> None:
    """Session(...)'s own arguments, before any process starts."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks({ranks}) must be a whole number >= 1")
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not " + " or ".join(repr(d) for d in DEVICES))
    if interface is not None and (not isinstance(interface, str) or not interface.strip()):
        raise ValueError(f"interface {interface!r} must be a network interface name such as 'eth0'")
    if not whole(snapshot_every):
        raise ValueError(f"snapshot_every({snapshot_every}) must be a whole number >= 0")
    if launch is not None and launch not in LAUNCHES:
        raise ValueError(f"launch {launch!r} is not " + ", ".join(repr(x) for x in LAUNCHES))
