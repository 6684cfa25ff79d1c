"""plan/estimate: pure arithmetic of bytes per rank and per collective (no torch, no processes).

Agreement with measured bytes is checked by tests/test_telemetry.py and, for activations
(with their rules by hand), tests/test_activations.py; here: the inventory matches the model's parameter count, and the rules (sharding, padding,
pipeline ownership, tied heads) hold on small hand-checkable cases."""
import pytest

from interactive_parallel import Plan
from interactive_parallel.plan import PRESETS
from interactive_parallel.plan.estimate import (chunk, gathered_bytes, local_tensors, param_inventory, predict_comms,
                                                predict_memory, rank_peak)
from interactive_parallel.plan.models import ModelSpec
from interactive_parallel.records import CommEstimate

pytestmark = pytest.mark.pure
LLAMA, GPT2 = PRESETS["tiny-llama"], PRESETS["tiny-gpt2"]
LLAMA_PARAMS = 279104  # counted from the built model: 2 * 128*64 + 4 * 65664 + 64


def test_inventory_counts_every_parameter_once():
    assert sum(_numel(p.shape) for p in param_inventory(LLAMA)) == LLAMA_PARAMS
    names = [p.name for p in param_inventory(GPT2)]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names  # tied head


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_chunk_follows_torch_chunk():
    assert [chunk(10, 4, i) for i in range(4)] == [3, 3, 3, 1]
    assert [chunk(5, 4, i) for i in range(4)] == [2, 2, 1, 0]
    assert [chunk(8, 4, i) for i in range(4)] == [2, 2, 2, 2]


def test_replicated_and_fsdp_bytes():
    rep = predict_memory(LLAMA, Plan(dp=4))
    assert all(r.params == r.grads == 4 * LLAMA_PARAMS for r in rep)
    assert all(r.optimizer == 8 * LLAMA_PARAMS + 4 * len(param_inventory(LLAMA)) for r in rep)
    fsdp = predict_memory(LLAMA, Plan(fsdp=4))
    assert all(r.params == LLAMA_PARAMS for r in fsdp)  # divides evenly: a quarter each


def test_fsdp_pads_uneven_shards_in_storage_not_in_moments():
    spec = ModelSpec(name="odd", family="llama", config=dict(LLAMA.config, vocab_size=130))
    recs = predict_memory(spec, Plan(fsdp=4))
    assert len({r.params for r in recs}) == 1  # padded storage: the same on every rank
    assert len({r.optimizer for r in recs}) == 2  # moments of the real shard: 33, 33, 33, 31 rows
    assert recs[0].optimizer - recs[3].optimizer == 2 * 2 * 2 * 64 * 4  # embed + head: 2 rows fewer each


def test_tp_shards_only_the_plan_linears():
    tp = {p.name: held for p, held, _ in local_tensors(LLAMA, Plan(tp=2), 0)}
    assert tp["model.layers.0.self_attn.q_proj.weight"] == 64 * 64 // 2
    assert tp["model.layers.0.mlp.down_proj.weight"] == 64 * 256 // 2
    assert tp["model.embed_tokens.weight"] == tp["lm_head.weight"] == 128 * 64 // 2  # on the vocabulary
    assert tp["model.norm.weight"] == 64
    whole = {p.name: held for p, held, _ in local_tensors(LLAMA, Plan(tp=2, vocab_parallel=False), 0)}
    assert whole["model.embed_tokens.weight"] == whole["lm_head.weight"] == 128 * 64


def test_the_vocabulary_ends_split_and_their_collectives():
    """Embedding and head 1/tp per rank (GPT-2's tied pair counted once), as the model's own TP plan
    has them; their two tp all-reduces of a [tokens, h] activation (the embedding's output, the
    head's input gradient) and the head's logits all-gathered, or under loss parallel the
    cross-entropy's three all-reduces of a [tokens] one instead, as the comm ledger measured
    them (tp2, 8x64: 28 -> 30 all-reduces and one [8, 64, 128] gather; loss parallel 33 all-reduces,
    3670016 -> 3932160 + 3 * 2048 bytes). vocab_parallel=False keeps both whole: no end collective."""
    for plan in (Plan(tp=2), Plan(tp=2, loss_parallel=True)):
        lp = {p.name: held for p, held, _ in local_tensors(LLAMA, plan, 1)}
        assert lp["model.embed_tokens.weight"] == lp["lm_head.weight"] == 128 * 64 // 2
        assert lp["model.layers.0.input_layernorm.weight"] == 64
        tied = [p.name for p, _, _ in local_tensors(GPT2, plan, 0)]
        assert tied.count("transformer.wte.weight") == 1 and "lm_head.weight" not in tied
        assert predict_memory(LLAMA, plan)[0].params == 559360  # measured by the probe
    comms = lambda plan: [(e.op, e.axis, e.count, e.bytes) for e in predict_comms(LLAMA, plan, 0)]  # noqa: E731
    assert comms(Plan(tp=2, vocab_parallel=False)) == [("all_reduce", "tp", 28, 3670016)]
    assert comms(Plan(tp=2)) == [("all_reduce", "tp", 30, 3932160), ("all_gather", "tp", 1, 8 * 64 * 128 * 4)]
    assert comms(Plan(tp=2, loss_parallel=True)) == [("all_reduce", "tp", 33, 3938304)]
    # bf16 autocast: the 8 rowwise outputs (2 a layer) in bf16, the 20 input gradients and the
    # embedding's output in fp32 (an embedding is not autocast), the logits in bf16
    assert comms(Plan(tp=2, precision="bf16", vocab_parallel=False)) == [
        ("all_reduce", "tp", 28, 8 * 131072 // 2 + 20 * 131072)]
    assert comms(Plan(tp=2, precision="bf16")) == [("all_reduce", "tp", 30, 8 * 131072 // 2 + 22 * 131072),
                                                   ("all_gather", "tp", 1, 8 * 64 * 128 * 2)]
    # full recomputation repeats a block's rowwise all-reduces but its last (torch's checkpoint stops early)
    assert [e.count for e in predict_comms(LLAMA, Plan(tp=2, recompute="full", vocab_parallel=False), 0)] == [28 + 4]


def test_pipeline_ownership_and_tied_head():
    owned = [{p.name for p, _, _ in local_tensors(GPT2, Plan(pp=2), r)} for r in (0, 1)]
    assert "transformer.wte.weight" in owned[0] and "transformer.wte.weight" in owned[1]
    assert "transformer.wpe.weight" not in owned[1] and "transformer.ln_f.weight" in owned[1]
    assert not any(n.startswith("transformer.h.2.") for n in owned[0])
    inter = Plan(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2)
    layers0 = {p.layer for p, _, _ in local_tensors(LLAMA, inter, 0) if p.layer is not None}
    assert layers0 == {0, 2}  # loop order: stages 0 and 2
    for schedule in ("zbv", "dualpipev"):  # a V: rank 0 holds stages 0 and 3, both ends of the model
        v = Plan(pp=2, pp_schedule=schedule, microbatches=4)
        assert {p.layer for p, _, _ in local_tensors(LLAMA, v, 0) if p.layer is not None} == {0, 3}
        ends = [{p.name for p, _, _ in local_tensors(GPT2, v, r)} for r in (0, 1)]
        assert {"transformer.wte.weight", "transformer.ln_f.weight"} <= ends[0]
        assert not ends[1] & {"transformer.wte.weight", "transformer.ln_f.weight", "transformer.wpe.weight"}


def test_comms_rules():
    dp = predict_comms(LLAMA, Plan(dp=4))
    assert dp == [CommEstimate(rank=0, op="all_reduce", axis="dp", count=None, bytes=4 * LLAMA_PARAMS)]
    fsdp = {d.op: d for d in predict_comms(LLAMA, Plan(fsdp=4))}
    assert fsdp["reduce_scatter"].bytes == 4 * LLAMA_PARAMS and fsdp["all_gather"].count == 10
    pp = {d.op: d for d in predict_comms(LLAMA, Plan(pp=2, dp=2, batch_size=8, seq_len=32))}
    assert pp["send"].bytes == 4 * 32 * 64 * 4  # 4 rows per dp rank, fp32 hidden states
    tp = {(d.op, d.axis): d for d in predict_comms(LLAMA, Plan(tp=2, dp=2))}
    # 2 rowwise forward + 5 colwise backward per layer, and the vocabulary ends' two
    assert tp[("all_reduce", "tp")].count == 4 * 7 + 2
    # under a pipeline every microbatch passes its stage's layers: m times the calls, each 1/m of
    # the bytes (half the layers of twice the rows, and one end of the two: tp2 x dp2's bytes)
    piped = {(d.op, d.axis): d for d in predict_comms(LLAMA, Plan(tp=2, pp=2, microbatches=4))}
    assert piped[("all_reduce", "tp")].count == 4 * (2 * 7 + 1) and \
        piped[("all_reduce", "tp")].bytes == tp[("all_reduce", "tp")].bytes
    ring = {(d.op, d.axis): d for d in predict_comms(LLAMA, Plan(cp=4, cp_method="ring"))}
    assert ("all_gather", "cp") not in ring  # 3 K|V hops forward, 3 K|V + 4 dK|dV hops backward, per layer
    assert ring[("send", "cp")].count == 4 * (3 + 3 + 4) and ring[("send", "cp")].bytes == 40 * 2 * 8 * 16 * 64 * 4


def test_a_pipelined_fsdp_rank_holds_its_stage_gathered_at_its_peak():
    """Under pp x fsdp every unit of a rank's stages stays gathered for the step: the bytes of the
    step's one all-gather per unit, in the units' dtype (half under bf16), counted in the rank's
    peak; without a pipeline, or without FSDP, nothing is counted."""
    for precision in ("fp32", "bf16"):
        plan = Plan(pp=2, fsdp=2, precision=precision)
        for rank in range(plan.world_size):
            gathers = {e.op: e.bytes for e in predict_comms(LLAMA, plan, rank) if e.axis == "fsdp"}["all_gather"]
            assert gathered_bytes(LLAMA, plan, rank) == gathers > 0
            m = predict_memory(LLAMA, plan, [rank])[0]
            assert rank_peak(LLAMA, plan, m) == m.params + m.grads + m.optimizer + m.activations + gathers
    for plan in (Plan(fsdp=4), Plan(pp=2, dp=2), Plan(pp=2, tp=2)):
        assert all(gathered_bytes(LLAMA, plan, r) == 0 for r in range(plan.world_size))
