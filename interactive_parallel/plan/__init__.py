"""Pure planning layer: Plan, validation, mesh axes, model specs, estimates (no torch)."""
from .axes import MESH_ORDER, MeshAxis, axis_groups, mesh_coords
from .models import FAMILIES, PRESETS, ModelSpec, UnknownModelError, resolve_model
from .plan import PP_SCHEDULES, PRECISIONS, Plan, PlanError, check, validate

__all__ = ["MESH_ORDER", "MeshAxis", "axis_groups", "mesh_coords", "FAMILIES", "PRESETS", "ModelSpec",
           "UnknownModelError", "resolve_model", "PP_SCHEDULES", "PRECISIONS", "Plan", "PlanError", "check",
           "validate"]
