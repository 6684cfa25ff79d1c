"""Pure planning layer: Plan, validation, mesh axes, model specs, estimates (no torch)."""
from .axes import MESH_ORDER, MeshAxis, axis_groups, expert_coords, expert_groups, mesh_coords, mesh_rank
from .models import FAMILIES, PRESETS, ModelSpec, UnknownModelError, resolve_model
from .plan import PP_SCHEDULES, PRECISIONS, Plan, PlanError, field_choices, field_docs
from .validate import check, validate

__all__ = ["MESH_ORDER", "MeshAxis", "axis_groups", "expert_coords", "expert_groups", "mesh_coords", "mesh_rank", "FAMILIES", "PRESETS", "ModelSpec",
           "UnknownModelError", "resolve_model", "PP_SCHEDULES", "PRECISIONS", "Plan", "PlanError", "check",
           "field_choices", "field_docs", "validate"]
