"""What the client does with a model and a plan in its own process, before or without any rank:
a model's spec with the family facts transformers gives, a dry run, and the cores it may use.

Owns the way the panel (widgets/), the command line (cli.py) and the package's `dry_run` reach
the runtime's client-side code (runtime.model.families, runtime.client.dryrun): they come here,
as DESIGN has them go through the Session or a client-side helper, never to runtime/ itself.
Each call loads torch and transformers in this process only when it needs them (a family
FAMILIES already holds, refused plans and unknown models load nothing). Knows nothing of ranks,
engines or ipyparallel, nor of how facts are derived or ranks simulated.
"""
from __future__ import annotations

from typing import Any

from ..plan import ModelSpec, Plan, check, resolve_model


def spec_of(model: Any) -> ModelSpec:
    """plan.resolve_model(model), with its family facts derived here when FAMILIES does not hold
    them (torch and transformers load here then); a hand-written family's spec as it is."""
    spec = resolve_model(model)
    if spec.needs_facts:
        from ..runtime.model.families import with_facts

        spec = with_facts(spec)
    return spec


def resolved(model: Any) -> ModelSpec:
    """plan.resolve_model(model) checked by transformers whatever its family (its config built, a
    forward run on the meta device) and with its family facts: what a rank would refuse is
    refused here, before any process starts (torch and transformers load here)."""
    from ..runtime.model.families import resolved as checked

    return checked(model)


def dry_run(model: Any, plan: Plan, world: int | None = None, **kwargs: Any):
    """`model` laid out under `plan` over `world` virtual ranks (default: the plan's) in this
    process, on fake tensors: runtime.client.dryrun's DryRun. A bad plan or model is refused
    before torch loads (but for a family derived from transformers, whose facts need it)."""
    spec = spec_of(model)  # a family derived from transformers: torch loads here, before the plan check
    check(plan, plan.world_size if world is None else world, spec)
    from ..runtime.client.dryrun import dry_run as simulate

    return simulate(spec, plan, world, **kwargs)


def usable_cores() -> int:
    """The cores this process may keep busy (its affinity, capped by a container's CPU quota)."""
    from ..runtime.rank.cores import usable_cores as cores

    return cores()
