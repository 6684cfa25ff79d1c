"""The expert-parallel styles a family's ep_plan may name, one record each (transformers' own names).

Owns `EpStyle` (what a style of transformers' `base_model_ep_plan` does to the module it names:
split the stacked expert weights on dim 0 over the ep ranks, or route the experts' forward
through an EP implementation that sends each token to its experts' rank and back) and
EP_STYLES. runtime.model.family_facts (which names a config may use, which module holds the
experts) and runtime.parallel.ep (in which order transformers applies them) read these records;
neither tests a style's name. Pure Python: knows no torch and no family; the TP styles are
plan.tp_styles'.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EpStyle:
    """One expert-parallel style: what ep does to one module of a mixture-of-experts block."""

    name: str
    splits_experts: bool = False
    """The module's stacked expert weights ([experts, ...]) split on dim 0 over the ep ranks, as
    DTensors on the ep mesh."""
    dispatches: bool = False
    """The module's forward routed through the EP implementation (the tokens sent to their experts'
    ranks and back): the module that holds the experts. transformers applies it after the
    parameters' styles, since it replaces a forward whose parameters must already be split."""
    about: str = ""


_ALL = (
    EpStyle("grouped_gemm", splits_experts=True, about="the stacked expert weights split on dim 0 over ep"),
    EpStyle("ep_dispatch_experts", dispatches=True,
            about="the experts' forward routed through the EP implementation: tokens there and back"),
)
EP_STYLES: dict[str, EpStyle] = {s.name: s for s in _ALL}
"""Style name -> its record."""
