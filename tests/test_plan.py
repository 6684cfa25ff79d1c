"""Plan validation: pure, no processes. Every problem is listed at once, naming its numbers."""
import pytest

from interactive_parallel import Plan, PlanError
from interactive_parallel.plan import PRESETS, MeshAxis, axis_groups, check, mesh_coords, resolve_model, validate
from interactive_parallel.plan.estimate import predict_comms
from interactive_parallel.plan.models import UnknownModelError

pytestmark = pytest.mark.pure
LLAMA = PRESETS["tiny-llama"]


def test_plan_is_frozen_and_keyword_only():
    p = Plan(dp=4)
    with pytest.raises(Exception):
        p.dp = 2
    with pytest.raises(TypeError):
        Plan(4)


def test_degrees_must_multiply_to_ranks_and_message_names_numbers():
    problems = validate(Plan(dp=2, tp=2, pp=2), 4, LLAMA)
    assert "dp(2) * tp(2) * pp(2) = 8 != ranks(4)" in problems


def test_all_problems_at_once():
    with pytest.raises(PlanError) as exc:
        check(Plan(dp=3, batch_size=8, seq_len=1000, precision="fp8"), 4, LLAMA)
    text = str(exc.value)
    assert "dp(3) = 3 != ranks(4)" in text
    assert "batch_size(8) is not divisible by dp(3) * fsdp(1) * grad_accum(1) = 3" in text
    assert "seq_len(1000) > tiny-llama max positions(256)" in text
    assert "precision 'fp8'" in text
    assert len(exc.value.problems) == 4


def test_tp_must_divide_heads():
    problems = validate(Plan(tp=3, dp=1), 3, LLAMA)
    assert "tp(3) does not divide num_attention_heads(4)" in problems


def test_loss_parallel_refused_without_tp_or_on_a_vocabulary_tp_does_not_split():
    assert validate(Plan(loss_parallel=True), 1, LLAMA) == [
        "loss_parallel needs tp > 1 (tp(1)): it splits the embedding, the head and the loss over the "
        "tensor-parallel ranks"]
    odd = resolve_model({**LLAMA.config, "vocab_size": 130})
    split = ["tp(4) does not divide vocab_size(130) (the embedding and the head are split on it; "
             "vocab_parallel=False keeps them whole)"]
    assert validate(Plan(tp=4, loss_parallel=True), 4, odd) == validate(Plan(tp=4), 4, odd) == split
    assert validate(Plan(tp=4, vocab_parallel=False), 4, odd) == []  # the ends whole: nothing splits the vocabulary
    assert validate(Plan(tp=2, vocab_parallel=False, loss_parallel=True), 2, LLAMA) == [
        "loss_parallel needs vocab_parallel: the loss is taken on the head's vocabulary-split logits, and "
        "vocab_parallel=False keeps the head whole"]
    assert validate(Plan(tp=2, pp=2, loss_parallel=True), 4, LLAMA) == []  # composes with the pipeline
    assert Plan(tp=2, loss_parallel=True).describe() == "tp2 loss-parallel"
    assert Plan(tp=2, vocab_parallel=False).describe() == "tp2 whole-vocab" and Plan(tp=2).describe() == "tp2"
    assert Plan(tp=2).vocab_split and not Plan(tp=2, vocab_parallel=False).vocab_split and not Plan().vocab_split


def test_non_positive_batch_and_degrees():
    assert "batch_size(0) must be >= 1" in validate(Plan(dp=1, batch_size=0), 1)
    assert any("must be a whole number >= 1" in p for p in validate(Plan(dp=0), 1))


def test_wrong_types_and_non_finite_numbers_are_problems_not_crashes():
    assert validate(Plan(batch_size="8", dp=True, tp=2.0), 1, LLAMA) == [
        "dp(True) must be a whole number, not bool", "tp(2.0) must be a whole number, not float",
        "batch_size('8') must be a whole number, not str"]
    assert validate(Plan(sequence_parallel=1, lr=None), 1) == [
        "sequence_parallel(1) must be a bool, not int", "lr(None) must be a float, not NoneType"]
    assert validate(Plan(lr=1), 1) == []  # an int learning rate is a number
    assert validate(Plan(lr=float("nan"), seed=-1, virtual_stages=0), 1) == [
        "lr(nan) must be a finite number > 0", "seed(-1) must be in 0 .. 2**63 - 1", "virtual_stages(0) must be >= 1"]


def test_gradient_clipping_takes_a_norm_of_zero_or_more_and_is_refused_with_ep():
    assert validate(Plan(max_grad_norm=1.0), 1) == [] and validate(Plan(max_grad_norm=0), 1) == []  # 0: off
    assert validate(Plan(max_grad_norm=-1.0), 1) == ["max_grad_norm(-1.0) must be a finite number >= 0 (0: no clipping)"]
    assert validate(Plan(max_grad_norm=float("inf")), 1) == [
        "max_grad_norm(inf) must be a finite number >= 0 (0: no clipping)"]
    assert validate(Plan(max_grad_norm="1"), 1) == ["max_grad_norm('1') must be a float, not str"]
    problems = validate(Plan(dp=2, ep=2, max_grad_norm=1.0), 2)
    assert any(p.startswith("max_grad_norm(1.0) with ep(2) is not supported yet") for p in problems), problems
    assert Plan(dp=2, max_grad_norm=1.0).same_layout(Plan(dp=2))  # a training knob: no re-layout


def test_fp16_refused_on_cpu_and_cuda_without_gpu():
    """(So the scaler's parity under tp2, tests/test_scaler.py, runs in fp32 on this machine.)"""
    problems = validate(Plan(tp=2, batch_size=2, seq_len=16, precision="fp16"), 2, LLAMA)
    assert any("precision 'fp16' needs device 'cuda'" in p for p in problems), problems
    assert any("no GPU" in p for p in validate(Plan(device="cuda"), 1, cuda_available=0))


def test_parse_from_command_line_text():
    assert Plan.parse("dp=2,tp=2 seq_len=32") == Plan(dp=2, tp=2, seq_len=32)
    with pytest.raises(PlanError):
        Plan.parse("dq=2")


def test_mesh_coordinates_tp_innermost():
    shape = Plan(dp=2, tp=2).mesh_shape
    assert mesh_coords(1, shape)[MeshAxis.TP] == 1 and mesh_coords(1, shape)[MeshAxis.DP] == 0
    assert axis_groups(shape, MeshAxis.TP) == [[0, 1], [2, 3]]
    assert axis_groups(shape, MeshAxis.DP) == [[0, 2], [1, 3]]


def test_resolve_model_presets_configs_and_unknown(tmp_path):
    assert resolve_model("tiny-gpt2").family == "gpt2"
    assert resolve_model({"model_type": "llama", "vocab_size": 128}).family == "llama"
    with pytest.raises(UnknownModelError, match="not a preset"):
        resolve_model("gpt-9000")
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 128, "num_hidden_layers": 2}')
    spec = resolve_model(str(tmp_path))
    assert spec.source == str(tmp_path.resolve()) and spec.num_layers == 2


def test_pipeline_stages_in_loop_order():
    inter = Plan(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2)
    assert inter.n_stages == 4 and inter.stage_ids(0) == [0, 2] and inter.stage_ids(1) == [1, 3]
    assert Plan(pp=4).n_stages == 4 and Plan(pp=4).stage_ids(3) == [3]


def test_v_schedules_hold_stages_r_and_2pp_minus_1_minus_r():
    for name in ("zbv", "dualpipev"):
        v = Plan(pp=4, pp_schedule=name, microbatches=8)
        assert v.n_stages == 8 and v.stage_ids(0) == [0, 7] and v.stage_ids(3) == [3, 4]
        assert [v.stage_owner(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    inter = Plan(pp=2, pp_schedule="interleaved-zb", virtual_stages=3)
    assert inter.stage_ids(1) == [1, 3, 5] and [inter.stage_owner(s) for s in range(6)] == [0, 1] * 3


def test_torch_schedule_names_are_read_as_ours():
    assert Plan(pp_schedule="ZBVZeroBubble").pp_schedule == "zbv"
    assert Plan(pp_schedule="interleavedzerobubble").pp_schedule == "interleaved-zb"
    assert Plan(pp_schedule="DualPipeV").pp_schedule == "dualpipev" and Plan(pp_schedule="GPipe").pp_schedule == "gpipe"
    assert any("not one of" in p and "ZBVZeroBubble" in p for p in validate(Plan(pp=2, pp_schedule="zb"), 2, LLAMA))


def test_uneven_stages_the_first_and_last_lighter():
    from interactive_parallel.plan.plan import split_layers
    assert split_layers(126, 16) == [7] + [8] * 14 + [7]  # Llama 3.1 405B on 16 stages (its paper's layout)
    assert split_layers(8, 4) == [2, 2, 2, 2] and split_layers(10, 4) == [2, 3, 3, 2]
    assert split_layers(3, 2) == [1, 2] and split_layers(5, 4) == [1, 2, 1, 1]
    assert split_layers(7, 4) == [1, 2, 2, 2]  # the middle first, then the last, then the first
    plan = Plan(pp=4)
    assert [plan.stage_layer_ids(10, s) for s in range(4)] == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    assert [plan.layer_stage(10, layer) for layer in (0, 1, 2, 7, 8, 9)] == [0, 0, 1, 2, 3, 3]
    given = Plan(pp=2, stage_layers=(1, 3))
    assert given.layer_counts(4) == [1, 3] and given.stage_layer_ids(4, 1) == [1, 2, 3]
    assert Plan.from_dict(given.to_dict() | {"stage_layers": [1, 3]}) == given
    assert Plan.parse("pp=2 stage_layers=1/3") == given


def test_uneven_stages_validated_with_their_numbers():
    spec = resolve_model("llama-3.1-405b")
    assert spec.num_layers == 126 and validate(Plan(pp=16, batch_size=16), 16, spec) == []
    assert "stage_layers has 3 entries for 2 pipeline stages" in validate(Plan(pp=2, stage_layers=(1, 1, 2)), 2, LLAMA)
    assert "stage_layers(1, 2) sum to 3 != num_hidden_layers(4)" in validate(Plan(pp=2, stage_layers=(1, 2)), 2, LLAMA)
    assert any("stage_layers(0, 4) must be whole numbers >= 1" in p
               for p in validate(Plan(pp=2, stage_layers=(0, 4)), 2, LLAMA))
    tied = PRESETS["tiny-gpt2"]
    assert any("tied embedding and head" in p for p in validate(Plan(pp=2, dp=2, pp_schedule="zbv"), 4, tied))
    assert not validate(Plan(pp=2, tp=2, pp_schedule="zbv"), 4, tied)
    assert "num_hidden_layers(4) < pipeline stages 2 * pp(4) = 8 (zbv's V)" in validate(
        Plan(pp=4, pp_schedule="zbv", microbatches=8, batch_size=8), 4, LLAMA)


def test_same_layout_ignores_only_what_does_not_change_the_shards():
    plan = Plan(dp=2, tp=2)
    assert plan.same_layout(plan.replace(batch_size=32, seq_len=16, grad_accum=2, lr=0.1, seed=7))
    assert not plan.same_layout(Plan(dp=4))
    assert not plan.same_layout(plan.replace(sequence_parallel=True))


def test_field_choices_come_from_the_literal_types():
    from interactive_parallel.plan.plan import (DEVICES, PP_SCHEDULES, PRECISIONS, RECOMPUTES, field_choices)
    assert field_choices("device") == DEVICES == ("cpu", "cuda")
    assert field_choices("precision") == PRECISIONS == ("fp32", "bf16", "fp16")
    assert field_choices("pp_schedule") == PP_SCHEDULES and "interleaved-1f1b" in PP_SCHEDULES
    assert field_choices("recompute") == RECOMPUTES == ("none", "selective", "full")
    assert field_choices("dp") is None and field_choices("sequence_parallel") is None
    assert field_choices("no_such_field") is None


def test_field_docs_one_line_per_field():
    import dataclasses

    from interactive_parallel.plan.plan import field_docs
    docs = field_docs()
    assert set(docs) == {f.name for f in dataclasses.fields(Plan)}
    assert docs["tp"] == "Tensor parallel: each weight matrix split across this many ranks."
    assert "\n" not in docs["recompute"] and docs["recompute"].startswith("Activation recomputation")
    assert field_docs() is docs


def test_uses_ddp_only_for_pure_data_parallelism():
    assert Plan(dp=4).uses_ddp and Plan(dp=2).uses_ddp
    assert not Plan().uses_ddp and not Plan(dp=2, tp=2).uses_ddp and not Plan(dp=2, fsdp=2).uses_ddp
    assert not Plan(fsdp=4).uses_ddp and not Plan(dp=2, pp=2).uses_ddp


@pytest.mark.parametrize("degrees, sharded, replicated", [
    (dict(dp=4), (), ("dp",)), (dict(dp=2, cp=2), (), ("dp", "cp")), (dict(cp=2, tp=2), (), ("cp",)),
    (dict(fsdp=4), ("fsdp",), ()), (dict(fsdp=2, cp=2), ("fsdp", "cp"), ()),
    (dict(dp=2, fsdp=2), ("fsdp",), ("dp",)), (dict(tp=4), (), ()), (dict(pp=2, dp=2), (), ("dp",))])
def test_the_gradients_axes_are_decided_once_and_the_comm_estimate_names_them(degrees, sharded, replicated):
    plan = Plan(**degrees, batch_size=8, seq_len=16)
    assert plan.gradient_axes == (sharded, replicated)
    assert plan.replicates_gradients == (not sharded and bool(replicated))
    assert plan.uses_ddp <= plan.replicates_gradients  # DDP is one of the replicated wrappers
    # tp, pp and the bare cp group carry activations too (cp: attention's K and V), so only the
    # folded groups are read here, where gradients alone travel
    groups = {(c.op, c.axis) for c in predict_comms(LLAMA, plan, 0) if c.axis not in ("tp", "pp", "cp")}
    expected = ({("all_gather", "_".join(sharded)), ("reduce_scatter", "_".join(sharded))} if sharded else set()) | \
        ({("all_reduce", "_".join(replicated))} if replicated and replicated != ("cp",) else set())
    assert groups == expected, groups


def _imports(path) -> set[str]:
    """Modules of the package that the file at `path` imports, at any level (function bodies too)."""
    import ast

    import interactive_parallel

    top = __import__("pathlib").Path(interactive_parallel.__file__).parent.parent
    package = ".".join(path.relative_to(top).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            out |= {target} | {f"{target}.{a.name}" for a in node.names}
    return out


def test_plan_and_serving_modules_import_no_circle():
    """plan.activations and plan.estimate share plan.inventory; runtime.inference.serve and
    runtime.inference.serve_transformers share runtime.inference.serve_records: neither of a pair
    imports the other back."""
    import pathlib

    import interactive_parallel
    root = pathlib.Path(interactive_parallel.__file__).parent
    files = [*root.joinpath("plan").glob("*.py"), *root.joinpath("runtime", "inference").glob("serve*.py")]
    graph = {".".join(f.relative_to(root.parent).with_suffix("").parts): _imports(f) for f in files
             if f.stem != "__init__"}
    circles = sorted((a, b) for a in graph for b in graph[a] if b in graph and a in graph[b] and a < b)
    assert circles == []


@pytest.mark.pure
def test_a_directory_with_a_config_alone_is_a_shape_with_seeded_weights(tmp_path):
    import json

    from interactive_parallel.plan import resolve_model

    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="llama", vocab_size=128)))
    spec = resolve_model(str(tmp_path))
    assert spec.source == str(tmp_path.resolve()) and not spec.has_weights
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)).has_weights
