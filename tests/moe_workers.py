"""Rank-side bodies of the mixture-of-experts tests (module level, so spawned ranks can import them).

Knows nothing of pytest. Specs are built on each rank from the config dicts (derived facts are
cached per process).
"""
from __future__ import annotations

from interactive_parallel.plan import Plan
from interactive_parallel.records import GenerateOptions

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
MOE = {"mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
       "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
       # the router's load-balancing loss on, at a weight that moves the gradients
       "mixtral_aux": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=0.05)}
PROMPTS = ["12+35=", "7+8=", "99+1=", "1+2+3+4+5="]


def config_of(name: str, **changes) -> dict:
    return dict(BASE, **MOE[name], **changes)


def spec_of(name: str, **changes):
    """The spec of MOE[name] (with `changes` to its config), its facts derived."""
    from interactive_parallel.plan.models import spec_from_config_dict
    from interactive_parallel.runtime.model.families import with_facts

    return with_facts(spec_from_config_dict(config_of(name, **changes), name=f"tiny-{name}"))


def train_group(rank: int, configs: list[tuple[str, str, dict]], steps: int) -> dict:
    """{label: losses, full grads and weights (rank 0), and every rank's step records}."""


    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.rank import state
    from interactive_parallel.runtime.training.train import make_optimizer, train_step
    from interactive_parallel.runtime.training.verify import global_loss, loss_and_grads

    out = {}
    for label, model_type, fields in configs:
        par = parallelize(spec_of(model_type), Plan(**fields))
        opt = make_optimizer(par)
        losses, records = [], []
        for step in range(steps):
            rec = train_step(par, opt, step, rank=rank)
            losses.append(global_loss(par, rec.loss))
            records.append(rec)
        loss, grads = loss_and_grads(par, steps)
        weights = par.full_state_dict()
        state.get().reset_model()
        first = records[0]
        out[label] = {"experts": [r.experts for r in records], "comms": first.comms, "memory": first.memory}
        if rank == 0:
            out[label].update(losses=losses + [loss], grads=grads, weights=weights)

    return out


def generate_group(rank: int, model_type: str, plans: list[dict], max_new_tokens: int) -> dict:
    """Greedy completions under each plan, from every rank."""
    from interactive_parallel.runtime import api

    api.load_model(spec_of(model_type))
    out = {}
    for fields in plans:
        api.apply_plan(Plan(**fields))
        out[Plan(**fields).describe()] = api.generate(PROMPTS, max_new_tokens, GenerateOptions()).texts
    return out
