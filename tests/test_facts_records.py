"""The facts kept as records, one per thing: the pipeline schedules (plan.schedules) and the tensor
parallel styles (plan.tp_styles), each record held to what torch and transformers say of it.

Pure: the registries' shape (names, the Plan field's choices, the order builders). rank1 (torch
in this process, no process group): every schedule torch's get_schedule_class knows has a record
or a reason; each record's placement, zero-bubble flag and microbatch rule match torch's class
built over mock stages; every style in any tp plan the package builds has a record, and
runtime.parallel.tp builds each style's ParallelStyle as its record says.
"""
from __future__ import annotations

import inspect
import itertools

import pytest

from interactive_parallel.plan import FAMILIES, Plan, field_choices
from interactive_parallel.plan import pipeline_order
from interactive_parallel.plan.schedules import (REFUSED_TORCH_SCHEDULES, SCHEDULE_NAMES, SCHEDULES,
                                                 schedule_named)
from interactive_parallel.plan.tp_styles import TP_ALIASES, TP_STYLES, tp_style

GRID = [(pp, m, v) for pp, m, v in itertools.product((2, 3, 4), range(1, 10), (1, 2, 3))]


# ---- schedules -----------------------------------------------------------------------------------
@pytest.mark.pure
def test_schedule_records_are_the_plan_fields_choices():
    assert SCHEDULE_NAMES == field_choices("pp_schedule") == tuple(s.name for s in SCHEDULES.values())
    assert len({s.torch_name.lower() for s in SCHEDULES.values()}) == len(SCHEDULES)
    builders = {f for _, f in inspect.getmembers(pipeline_order, inspect.isfunction) if not f.__name__.startswith("_")}
    for s in SCHEDULES.values():
        assert s.order in builders, s.name
        assert schedule_named(s.torch_name) is schedule_named(s.torch_name.upper()) is schedule_named(s.name) is s
        assert Plan(pp=2, pp_schedule=s.torch_name).schedule is s
        assert s.zero_bubble == Plan(pp=2, pp_schedule=s.name).zero_bubble
    assert schedule_named("LoopedBFS") is None and set(REFUSED_TORCH_SCHEDULES).isdisjoint(
        s.torch_name for s in SCHEDULES.values())


@pytest.mark.pure
@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_each_order_runs_every_microbatch_on_every_stage_it_holds(name):
    s = SCHEDULES[name]
    for pp, m, v in GRID:
        if s.problems(pp, m, v) or (v > 1 and not s.looped):
            continue
        for rank in range(pp):
            ops = s.ops(pp, rank, m, v)
            for local in range(s.stages_per_rank(v)):
                acts = [a for a, stage, _ in ops if stage == local]
                assert acts.count("F") == acts.count("B") == m, (name, pp, m, v, rank)
                assert acts.count("W") == (m if s.zero_bubble else 0), (name, pp, m, v, rank)
            assert sorted(s.stage_owner(pp, x) for x in s.stage_ids(pp, rank, v)) == [rank] * s.stages_per_rank(v)


@pytest.mark.rank1
def test_every_schedule_torch_knows_has_a_record_or_a_reason():
    from torch.distributed.pipelining import schedules as torch_schedules

    known = {name.removeprefix("Schedule") for name, cls in vars(torch_schedules).items()
             if inspect.isclass(cls) and issubclass(cls, torch_schedules._PipelineSchedule)
             and not name.startswith("_")}
    for name in known:
        torch_schedules.get_schedule_class(name)  # spelled as get_schedule_class takes it
    ours = {s.torch_name for s in SCHEDULES.values()}
    assert known == ours | set(REFUSED_TORCH_SCHEDULES), (known ^ (ours | set(REFUSED_TORCH_SCHEDULES)))
    assert all(REFUSED_TORCH_SCHEDULES.values())


@pytest.mark.rank1
@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_each_record_is_torchs_class(name):
    """Placement (single class or not, which stages each rank holds), zero bubble (input and weight
    halves in torch's order) and the microbatch rule (torch's class refuses the same counts) as
    torch's class built over mock stages says."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from interactive_parallel.runtime.client.schedule_preview import torch_order

    s = SCHEDULES[name]
    assert issubclass(get_schedule_class(s.torch_name), PipelineScheduleSingle) == (s.placement == "single")
    for pp, m, v in GRID:
        if v > 1 and not s.looped:
            continue
        plan = Plan(pp=pp, microbatches=m, virtual_stages=v, pp_schedule=name)
        try:
            order = torch_order(plan)
        except (ValueError, RuntimeError, AssertionError):
            assert s.problems(pp, m, v), (name, pp, m, v, "torch refuses, the record does not")
            continue
        if v < s.min_virtual_stages:  # ours, stricter than torch's class
            assert s.problems(pp, m, v)
            continue
        assert not s.problems(pp, m, v), (name, pp, m, v, "the record refuses what torch builds")
        kinds = set()
        for rank, acts in order.items():
            flat = [x for a in acts for x in (a.sub_actions or (a,))]
            assert {a.stage_index for a in flat} == set(plan.stage_ids(rank)), (name, pp, m, v, rank)
            kinds |= {a.computation_type.value for a in flat}
        assert ("W" in kinds) == s.zero_bubble, (name, kinds)


# ---- TP styles -----------------------------------------------------------------------------------
@pytest.mark.pure
def test_tp_style_records():
    assert TP_ALIASES == {"colwise_rep": "colwise_gather_output", "rowwise_rep": "rowwise_split_input"}
    for name, s in TP_STYLES.items():
        assert s.name == name and s.about
        assert s.reduces_output == (s.shards == "input") and s.reduces_input_grad == (s.shards == "output")
        assert not (s.gathers_output and s.shards != "output") and not (s.slices_input and s.shards != "input")
        assert not (s.packed and s.gathers_output), "a regrouped projection leaves its heads split"
    # what the collectives follow from, and the dims an (out, in) and an (in, out) weight split on
    colwise, rowwise = TP_STYLES["colwise"], TP_STYLES["rowwise"]
    assert colwise.forward_collectives == () and colwise.backward_collectives == ("all_reduce",)
    assert rowwise.forward_collectives == ("all_reduce",) and rowwise.backward_collectives == ()
    assert TP_STYLES["colwise_gather_output"].forward_collectives == ("all_gather",)
    assert TP_STYLES["rowwise_split_input"].backward_collectives == ("all_gather",)
    assert [TP_STYLES["colwise"].weight_dim(t) for t in (False, True)] == [0, 1]
    assert [TP_STYLES["rowwise"].weight_dim(t) for t in (False, True)] == [1, 0]
    assert TP_STYLES["rowwise"].bias_dim is None and TP_STYLES["colwise"].bias_dim == 0
    with pytest.raises(ValueError, match="TP style 'packed_rowwise' is not one of colwise, rowwise"):
        tp_style("packed_rowwise")


@pytest.mark.pure
def test_every_style_of_the_hand_held_families_has_a_record():
    for name, fam in FAMILIES.items():
        assert set(fam.tp_plan.values()) <= set(TP_STYLES), name
        assert set(fam.block_tp_records()) == set(fam.block_tp_styles()), name


@pytest.mark.rank1
def test_every_style_transformers_gives_the_models_laid_out_here_has_a_record():
    """The configs the package ships and the families tests/test_any_model.py lays out: each style
    their config class's tp plan names has a record (aliases folded); a style with none is refused
    when the family is derived, in runtime.model.family_facts' words."""
    from torch import nn
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from interactive_parallel.plan.models import CONFIGS, resolve_model
    from interactive_parallel.plan.models import UnknownModelError
    from interactive_parallel.runtime.model.family_facts import _tp_styles

    types = {resolve_model(n).config.get("model_type") for n in CONFIGS} | {"mistral", "qwen2", "qwen3", "gemma",
                                                                            "gemma3_text", "phi3", "olmo2", "glm"}
    for model_type in sorted(types - {None}):
        for style in (CONFIG_MAPPING[model_type].base_model_tp_plan or {}).values():
            assert TP_ALIASES.get(style, style) in TP_STYLES, (model_type, style)
            assert TP_STYLES[TP_ALIASES.get(style, style)].from_transformers, (model_type, style)
    block = nn.Module()
    block.proj = nn.Linear(4, 4)
    with pytest.raises(UnknownModelError, match="'packed_rowwise', which is not mapped here"):
        _tp_styles({"layers.*.proj": "packed_rowwise"}, "layers", block, "m")


@pytest.mark.rank1
@pytest.mark.parametrize("name", list(TP_STYLES))
def test_tp_builds_each_style_as_its_record_says(name):
    from torch.distributed.tensor import Replicate

    from interactive_parallel.runtime.parallel.tp import Colwise, ReplicatedHeadNorm, Rowwise, _style

    s = TP_STYLES[name]
    for transposed in (False, True):
        built = _style(name, transposed, Replicate())
        if not s.linear:
            assert isinstance(built, ReplicatedHeadNorm)
            continue
        assert isinstance(built, Colwise if s.shards == "output" else Rowwise) and built.transposed == transposed
        if s.shards == "output":
            assert isinstance(built.output_layouts[0], Replicate) == s.gathers_output
        else:
            assert isinstance(built.input_layouts[0], Replicate) == s.slices_input


# ---- EP styles -----------------------------------------------------------------------------------
@pytest.mark.rank1
def test_every_style_of_the_ep_plans_laid_out_here_has_a_record():
    """The shipped mixture of experts' ep plan names recorded styles only: one that dispatches (the
    experts' module) and the rest split stacked weights."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from interactive_parallel.plan.ep_styles import EP_STYLES
    from interactive_parallel.plan.models import CONFIGS, resolve_model

    for n in CONFIGS:
        model_type = resolve_model(n).config.get("model_type")
        ep_plan = getattr(CONFIG_MAPPING[model_type], "base_model_ep_plan", None) or {}
        assert set(ep_plan.values()) <= set(EP_STYLES), (n, ep_plan)
        if ep_plan:
            assert sum(EP_STYLES[v].dispatches for v in ep_plan.values()) == 1, n
            assert all(EP_STYLES[v].splits_experts != EP_STYLES[v].dispatches for v in ep_plan.values())
