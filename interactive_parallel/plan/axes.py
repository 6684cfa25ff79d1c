"""Names of the DeviceMesh axes ("axis" = mesh axis; "dim" = tensor dimension).

Owns the axis vocabulary and the order in which axes are laid out on the mesh.
Knows nothing about torch: the runtime turns these names into a DeviceMesh.
"""
from __future__ import annotations

from enum import StrEnum


class MeshAxis(StrEnum):
    PP = "pp"      # pipeline stages
    DP = "dp"      # data parallel, replicated parameters (DDP / HSDP replicate)
    FSDP = "fsdp"  # data parallel, sharded parameters (FSDP2)
    CP = "cp"      # context parallel: the sequence split across ranks
    TP = "tp"      # tensor parallel: weights split inside a layer


# Outermost first. TP innermost so that a TP group is a run of neighbouring ranks
# (one host, fastest links); PP outermost because its traffic is the lightest.
MESH_ORDER: tuple[MeshAxis, ...] = (MeshAxis.PP, MeshAxis.DP, MeshAxis.FSDP, MeshAxis.CP, MeshAxis.TP)


def mesh_coords(rank: int, shape: dict[MeshAxis, int]) -> dict[MeshAxis, int]:
    """Coordinates of `rank` on a row-major mesh laid out in MESH_ORDER."""
    coords: dict[MeshAxis, int] = {}
    rest = rank
    for axis in reversed(MESH_ORDER):
        size = shape.get(axis, 1)
        coords[axis] = rest % size
        rest //= size
    return {axis: coords[axis] for axis in MESH_ORDER}


def mesh_rank(coords: dict[MeshAxis, int], shape: dict[MeshAxis, int]) -> int:
    """The rank at `coords` on a row-major mesh laid out in MESH_ORDER (mesh_coords' inverse)."""
    rank = 0
    for axis in MESH_ORDER:
        rank = rank * shape.get(axis, 1) + coords.get(axis, 0)
    return rank


def axis_groups(shape: dict[MeshAxis, int], axis: MeshAxis) -> list[list[int]]:
    """The rank groups along `axis`: ranks that differ only in their `axis` coordinate."""
    world = 1
    for a in MESH_ORDER:
        world *= shape.get(a, 1)
    groups: dict[tuple, list[int]] = {}
    for r in range(world):
        c = mesh_coords(r, shape)
        key = tuple(v for a, v in c.items() if a != axis)
        groups.setdefault(key, []).append(r)
    return list(groups.values())
