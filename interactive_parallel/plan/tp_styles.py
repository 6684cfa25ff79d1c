"""The tensor-parallel styles a family's tp_plan may name, one record each: every fact about a style decided once.

Owns `TpStyle` (which features of a module tp splits, whether its output is gathered whole or
left partial for a sum, whether its input arrives whole and is sliced, whether it is a fused
projection regrouped per head, whether its weight's gradient is summed over tp, and the
collectives that follow from these), TP_STYLES (transformers' names, as its
`base_model_tp_plan` spells them, but for GPT-2's hand-written fused one) and TP_ALIASES
(transformers' other names for the same styles). runtime.parallel.tp (which torch
ParallelStyle to build), runtime.model.family_facts (which names a config may use) and the
estimator (plan.activations, plan.estimate, plan.inventory: what is split, what is summed)
read these records; none tests a style's name. Adding a style: one record here, and its
ParallelStyle in runtime.parallel.tp where no field already says how to build it. Whether a
weight is stored transposed (transformers' Conv1D) is the family's fact
(FamilyInfo.weights_transposed), not the style's: `weight_dim` takes it. Pure Python: knows no
torch and no family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Shards = Literal["output", "input", "none"]


@dataclass(frozen=True)
class TpStyle:
    """One tensor-parallel style: what tp does to one module of a decoder block."""

    name: str
    shards: Shards
    """Which features tp splits: a linear's output features (colwise: the input arrives whole,
    the output leaves split), its input features (rowwise: each rank's output is a partial sum,
    all-reduced), or none (the module stays whole on every tp rank: it is not a linear)."""
    gathers_output: bool = False
    """The split output is all-gathered whole again (a fused projection the model splits by
    global widths, or one a full-width norm follows)."""
    slices_input: bool = False
    """Rowwise on an input that arrives whole: each rank takes its own slice (no collective
    forward; the input's gradient all-gathered backward)."""
    packed: Literal["", "qkv"] = ""
    """A fused projection whose output features are regrouped per head before the split, so each
    rank holds whole heads: 'qkv' ([q | k | v], runtime.parallel.tp.fused_qkv_permutation)."""
    sums_weight_grad: bool = False
    """The weight whole on every rank, its gradient summed over tp (each rank's covers only its
    own heads)."""
    from_transformers: bool = True
    """Whether a transformers config's tp plan may name it (False: written here for a FAMILIES
    entry whose config ships no tp plan: GPT-2's)."""
    aliases: tuple[str, ...] = ()
    """transformers' other names for it."""
    about: str = ""

    @property
    def linear(self) -> bool:
        """Whether it splits a linear (runtime.model.family_facts refuses it on any other module)."""
        return self.shards != "none"

    @property
    def reduces_output(self) -> bool:
        """Its output is a partial sum over tp, all-reduced forward (a reduce-scatter under
        sequence parallelism): rowwise."""
        return self.shards == "input"

    @property
    def reduces_input_grad(self) -> bool:
        """Its input arrives whole and its gradient is a partial sum over tp, all-reduced backward: colwise."""
        return self.shards == "output"

    @property
    def splits_output(self) -> bool:
        """Each rank's output holds only its own features (the modules after it compute on their share)."""
        return self.shards == "output" and not self.gathers_output

    @property
    def forward_collectives(self) -> tuple[str, ...]:
        """The tp collectives one forward of it runs, without sequence parallelism (under it the
        rowwise all-reduce is a reduce-scatter)."""
        return ("all_reduce",) * self.reduces_output + ("all_gather",) * self.gathers_output

    @property
    def backward_collectives(self) -> tuple[str, ...]:
        """The tp collectives its backward runs, without sequence parallelism: the input
        gradient's all-reduce (colwise) or all-gather (a sliced input), the weight gradient's sum."""
        return (("all_reduce",) * self.reduces_input_grad + ("all_gather",) * self.slices_input
                + ("all_reduce",) * self.sums_weight_grad)

    def weight_dim(self, transposed: bool) -> int | None:
        """The dim of its weight tp splits (None: whole): output features are dim 0 of an
        (out, in) weight, dim 1 of a transposed (in, out) one (transformers' Conv1D)."""
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        return {"output": out_dim, "input": in_dim, "none": None}[self.shards]

    @property
    def bias_dim(self) -> int | None:
        """The dim of its bias tp splits: a colwise bias follows the output features; a rowwise
        one is added after the all-reduce, whole."""
        return 0 if self.shards == "output" else None


_ALL = (
    TpStyle("colwise", "output",
            about="output features split over tp; the input arrives whole, the output leaves sharded"),
    TpStyle("rowwise", "input",
            about="input features split over tp; the partial outputs are all-reduced, the bias is replicated"),
    TpStyle("colwise_fused_qkv", "output", packed="qkv", from_transformers=False,
            about="colwise on a fused [q | k | v] projection whose output features are regrouped per head "
                  "first, so each tp rank holds the q, k and v of its own heads"),
    TpStyle("colwise_gather_output", "output", gathers_output=True, aliases=("colwise_rep",),
            about="colwise, its output gathered whole again (a fused projection the model splits by global "
                  "widths, or one a full-width norm follows)"),
    TpStyle("rowwise_split_input", "input", slices_input=True, aliases=("rowwise_rep",),
            about="rowwise on an input that arrives whole: each rank takes its own slice of it"),
    TpStyle("replicated_with_grad_allreduce", "none", sums_weight_grad=True,
            about="a norm between a colwise and a rowwise linear, normalizing each head on its own: its "
                  "weight whole on every rank, its gradient summed over tp"),
)
TP_STYLES: dict[str, TpStyle] = {s.name: s for s in _ALL}
"""Style name -> its record."""
TP_ALIASES: dict[str, str] = {alias: s.name for s in _ALL for alias in s.aliases}
"""transformers' other names -> ours (the records' aliases)."""


def tp_style(name: str) -> TpStyle:
    """The record of style `name`; ValueError naming every style for one no record has."""
    if name not in TP_STYLES:
        raise ValueError(f"TP style {name!r} is not one of {', '.join(TP_STYLES)}")
    return TP_STYLES[name]
