"""Rank-side bodies of the multi-rank tests (module level, so spawned ranks can import them).

Each worker runs several plans in one spawned group, tearing down and re-applying, and
returns plain tensors and numbers from rank 0 only. Knows nothing of pytest.
"""
from __future__ import annotations

from interactive_parallel.plan import PRESETS, Plan
from interactive_parallel.records import GenerateOptions


def train_and_grads(spec, plan: Plan, steps: int, computes_like: Plan | None = None, rank: int = 0) -> dict:
    """Per-step global losses, then loss/full grads on the next batch and the full weights; the
    memory and comm records of the first step and this rank's shard records. `computes_like`: the
    parallel plan a one-process reference casts as (runtime.training.verify.computes_like)."""
    from interactive_parallel.runtime import probes
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.rank import state
    from interactive_parallel.runtime.training.train import make_optimizer, train_step
    from interactive_parallel.runtime.training.verify import global_loss, loss_and_grads

    par = parallelize(spec, plan)
    par.computes_like = computes_like
    opt = make_optimizer(par)
    losses, norms, first, shards = [], [], None, []
    for step in range(steps):
        rec = train_step(par, opt, step, rank=rank)
        losses.append(global_loss(par, rec.loss))
        norms.append(rec.grad_norm)
        if first is None:  # the layout as a step leaves it (what one_step_records reads)
            first, shards = rec, probes.shard_records(par, rank)
    loss, grads = loss_and_grads(par, steps)
    weights = par.full_state_dict()
    state.get().reset_model()
    return {"losses": losses + [loss], "grads": grads, "weights": weights, "memory": first.memory,
            "comms": first.comms, "grad_norms": norms, "shards": shards}


def assert_parity(got: dict, ref: dict, tols: tuple[float, float, float], label: str = "") -> None:
    """Losses, full gradients and weights of a parallel run within (loss, grad, weight) tolerances of one process's."""
    loss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    assert loss < tols[0], (label, got["losses"], ref["losses"])
    assert max_diff(got["grads"], ref["grads"]) < tols[1], label
    assert max_diff(got["weights"], ref["weights"]) < tols[2], label


def max_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two dicts of tensors with the same names."""
    assert set(a) == set(b), f"names differ: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def as_spec(model):
    """A preset's name or a ModelSpec (a derived family's, facts included)."""
    return PRESETS[model] if isinstance(model, str) else model


def parity_group(rank: int, configs: list[tuple], steps: int) -> dict:
    """{label: train_and_grads(...)} for each (label, preset or spec, plan fields); rank 0 returns."""
    out = {}
    for label, model, fields in configs:
        out[label] = train_and_grads(as_spec(model), Plan(**fields), steps)
    return out if rank == 0 else {}


_REFERENCES: dict[str, dict] = {}


def parity_and_records(rank: int, configs: list[tuple], steps: int, recorded: list[str],
                       one_step: list[tuple]) -> dict:
    """The parity runs of `configs` (parity_group's, on rank 0) and, on every rank, {(label,
    precision): (MemoryRecord, [CommRecord], [ShardRecord])}: the first step's of the runs
    labelled in `recorded` (fp32), and one step of each (label, model, fields) in `one_step` in
    bf16. One group, so each fp32 plan is laid out and stepped once for both."""
    runs, records = {}, {}
    for label, model, fields in configs:
        out = train_and_grads(as_spec(model), Plan(**fields), steps, rank=rank)
        if label in recorded:
            records[label, "fp32"] = (out["memory"], out["comms"], out["shards"])
        if rank == 0:
            runs[label] = out
    for label, recs in one_step_records(rank, one_step, "bf16").items():
        records[label, "bf16"] = recs
    return {"runs": runs, "records": records}


def reference(model, fields: dict, steps: int) -> dict:
    """The same run in this process alone (no process group). Many plans share one reference
    (reference_plan keeps only the batch, precision, learning rate and seed): each is computed
    once per process, keyed by the model's whole spec, that plan and the steps; callers only
    read it."""
    from interactive_parallel.runtime.training.verify import computes_like, reference_plan

    spec, plan = as_spec(model), reference_plan(Plan(**fields))
    like = computes_like(Plan(**fields))
    key = repr((spec, plan, steps, like and (like.gathers_bf16, like.ep > 1)))
    if key not in _REFERENCES:
        _REFERENCES[key] = train_and_grads(spec, plan, steps, like)
    return _REFERENCES[key]


def one_step_records(rank: int, configs: list[tuple[str, str, dict]], precision: str) -> dict:
    """{label: (MemoryRecord, [CommRecord], [ShardRecord])} of one training step per plan on this rank."""
    from interactive_parallel.runtime import probes
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.rank import state
    from interactive_parallel.runtime.training.train import make_optimizer, train_step

    out = {}
    for label, preset, fields in configs:
        par = parallelize(as_spec(preset), Plan(**fields, precision=precision))
        rec = train_step(par, make_optimizer(par), 0, rank=rank)
        out[label] = (rec.memory, rec.comms, probes.shard_records(par, rank))
        state.get().reset_model()
    return out


PROMPTS = ["12+35=", "7+8=", "99+1="]
PADDED_PROMPTS = ["12+35=", "7+8=", "99+1=", "1+2+3+4+5=", "3="]
"""Prompts of different lengths: the batch is left-padded."""


def generate_group(rank: int, plans: list[dict], max_new_tokens: int) -> dict:
    """Greedy and sampled completions under each plan, from every rank (they must agree)."""
    import torch

    from interactive_parallel.runtime import api
    from interactive_parallel.runtime.rank import state

    api.load_model(PRESETS["tiny-llama"])
    out = {}
    for fields in plans:
        api.apply_plan(Plan(**fields))
        greedy = api.generate(PROMPTS, max_new_tokens, GenerateOptions())
        sampled = api.generate(PROMPTS, max_new_tokens, GenerateOptions(do_sample=True, top_k=20, seed=3))
        par = state.get().parallel
        groups = [par.mesh[n].get_group() for n in par.mesh.mesh_dim_names]
        timeouts = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]
        raw = par.raw
        sp_norm = type(raw.get_submodule("model.layers.0.input_layernorm").weight).__name__
        out[_label(fields)] = {"greedy": greedy.texts, "sampled": sampled.texts, "norm_type": sp_norm,
                               "timeouts": timeouts, "steps": greedy.steps}
    return out


def _label(fields: dict) -> str:
    label = Plan(**fields).describe() + ("-sp" if fields.get("sequence_parallel") else "")
    return label + ("-interleaved" if fields.get("pp_schedule") == "interleaved-1f1b" else "")


def oracle_group(rank: int, model_dirs: dict[str, str], plans: list[dict], max_new_tokens: int) -> dict:
    """{(family dir name, plan label): greedy completions of PADDED_PROMPTS, merged over replicas}
    for a model read from each local directory, under each plan."""
    import torch.distributed as dist

    from interactive_parallel.plan import resolve_model
    from interactive_parallel.runtime import api

    out = {}
    for name, path in model_dirs.items():
        api.load_model(resolve_model(path))
        for fields in plans:
            api.apply_plan(Plan(**fields))
            texts = api.generate(PADDED_PROMPTS, max_new_tokens, GenerateOptions()).texts
            parts: list = [None] * dist.get_world_size()
            dist.all_gather_object(parts, texts)
            merged = {i: t for part in parts for i, t in part.items()}
            out[(name, _label(fields))] = [merged[i] for i in range(len(PADDED_PROMPTS))]
    return out if rank == 0 else {}


def spiky_model_dir(preset: str, path: str) -> str:
    """A model of `preset` with large random weights written to `path` (save_pretrained): its
    greedy tokens vary from position to position, unlike a freshly initialised model's
    (GPT-2's init repeats one token), so comparing completions says something."""
    import torch

    from interactive_parallel.runtime.model.models import build_model

    model = build_model(PRESETS[preset])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(path)
    return path


def hf_generate(model, prompts: list[str], max_new_tokens: int) -> list[str]:
    """The oracle: transformers' own `generate` (greedy, its own KV cache) on a one-process
    model, the vocabulary's padding rows suppressed as runtime.inference.generate does."""
    from interactive_parallel.runtime.inference.generate import decode_new, encode
    from interactive_parallel.runtime.model.tokenizer import get_tokenizer

    tok = get_tokenizer()
    ids, mask = encode(prompts, "cpu")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                         suppress_tokens=list(range(len(tok), model.config.vocab_size)),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return decode_new(out[:, ids.shape[1]:])


def hf_generate_dir(path: str, prompts: list[str], max_new_tokens: int) -> list[str]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    return hf_generate(model, prompts, max_new_tokens)


def reference_generate(max_new_tokens: int) -> list[str]:
    """transformers' generate on the seeded tiny-llama: the weights every plan starts from
    (runtime.layout.initialize's), in one plain transformers model."""
    from interactive_parallel.runtime.layout.parallelize import parallelize

    return hf_generate(parallelize(PRESETS["tiny-llama"], Plan()).raw.eval(), PROMPTS, max_new_tokens)


def _logits(ids):
    from interactive_parallel.runtime.rank import state

    return state.get().parallel.forward_logits(ids).detach().clone()


def replan_group(rank: int, preset: str, save_plan: dict, replan: dict, load_plan: dict, path: str) -> dict:
    """Hot re-plan and checkpoint round trip through runtime.api; rank 0 returns the logits seen."""
    from interactive_parallel.runtime import api
    from interactive_parallel.runtime.rank import state
    from interactive_parallel.runtime.training.data import global_batch

    ids = global_batch(7, 0, 2, 16)[:, :-1]
    api.load_model(PRESETS[preset])
    api.apply_plan(Plan(**save_plan))
    api.train(1)  # move the weights off their seeded init
    before = _logits(ids)
    verified = api.verify()
    api.save_checkpoint(path)
    api.apply_plan(Plan(**replan))  # hot re-plan: the weights carry over
    replanned = _logits(ids)
    api.apply_plan(Plan(**load_plan))
    api.train(1)  # change the weights, so the load has something to undo
    changed = _logits(ids)
    info = api.load_checkpoint(path)
    loaded = _logits(ids)
    verified_after = api.verify()
    # New batch and sequence sizes under a pipeline: the schedule must be rebuilt, not reused.
    api.update_training(state.get().plan.replace(seq_len=32, batch_size=4))
    api.train(1)
    resized = api.verify()
    result = {"before": before, "replanned": replanned, "changed": changed, "loaded": loaded, "info": info,
              "verify": verified, "verify_after": verified_after, "verify_resized": resized}
    return result if rank == 0 else {"verify": verified}


def replan_groups(rank: int, scenarios: list[tuple], bf16_plan: dict) -> dict:
    """replan_group for each (preset, save, replan, load, path), then verify() under bf16 autocast."""
    from interactive_parallel.runtime import api

    out = {s[0]: replan_group(rank, *s) for s in scenarios}
    api.apply_plan(Plan(**bf16_plan, precision="bf16"))
    api.train(1)
    out["bf16"] = api.verify()
    return out


def _qkvw(shape: tuple, groups: int):
    import torch

    torch.manual_seed(0)
    kv_shape = (shape[0], shape[1] // groups, shape[2], shape[3])
    q, k, v = torch.randn(shape), torch.randn(kv_shape), torch.randn(kv_shape)
    w = torch.randn(shape[0], shape[2], shape[1], shape[3])  # weights of the output, (B, S, H, D)
    return q, k, v, w


def cp_attention_grads(rank: int, shape: tuple, cp: int, method: str = "allgather", groups: int = 1,
                       window: int | None = None) -> dict:
    """Output and dQ/dK/dV of cp_attention on this rank's load-balanced share of a causal sequence
    (`groups` query heads per kv head, an optional sliding `window`)."""
    import torch.distributed as dist
    from torch import nn

    from interactive_parallel.runtime.parallel.cp import cp_attention, shard_sequence

    q, k, v, w = _qkvw(shape, groups)
    module = nn.Module()
    module._ip_cp_group, module.num_key_value_groups, module._ip_cp_method = dist.group.WORLD, groups, method
    module.sliding_window = window
    local = [shard_sequence(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out, _ = cp_attention(module, *local, None, scaling=shape[-1] ** -0.5)
    (out * shard_sequence(w, cp, rank, dim=1)).sum().backward()
    return {"out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}


def cp_attention_cases(rank: int, cases: list[tuple]) -> list[dict]:
    """cp_attention_grads for each (shape, cp, method, groups, window), in one spawned group."""
    return [cp_attention_grads(rank, *case) for case in cases]


def cp_attention_reference(shape: tuple, groups: int = 1, window: int | None = None) -> dict:
    import torch
    import torch.nn.functional as F

    q, k, v, w = _qkvw(shape, groups)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    s = shape[2]
    pos = torch.arange(s)
    mask = pos[:, None] >= pos[None, :]
    if window:
        mask &= pos[:, None] - pos[None, :] < window
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                         attn_mask=mask, scale=shape[-1] ** -0.5).transpose(1, 2)
    (out * w).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def ring_comm_records(rank: int, fields: dict) -> dict:
    """The comm records of one training step (forward and backward) of tiny-llama under `fields`."""
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.rank import state
    from interactive_parallel.runtime.training.train import make_optimizer, train_step

    par = parallelize(PRESETS["tiny-llama"], Plan(**fields))
    rec = train_step(par, make_optimizer(par), 0, rank=rank)
    state.get().reset_model()
    return {"comms": rec.comms, "coords": par.coords}


def ring_group(rank: int, attention_cases: list[tuple], configs: list[tuple], steps: int, comm_plan: dict) -> dict:
    """Ring CP in one spawned group: cp_attention cases, parity_group runs and one step's comm
    records under `comm_plan` (every rank's attention results and records; rank 0's parity runs)."""
    attention = cp_attention_cases(rank, attention_cases)
    parity = parity_group(rank, configs, steps)
    return {"attention": attention, "parity": parity, **ring_comm_records(rank, comm_plan)}
