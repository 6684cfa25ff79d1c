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


def expert_coords(rank: int, shape: dict[MeshAxis, int], ep: int) -> tuple[int, int]:
    """(expert replica, ep rank) of `rank`: expert parallelism rides on the data-parallel ranks
    (dp, fsdp and cp folded into one index, cp fastest), cut into runs of `ep` neighbours, so the
    ranks of one ep group differ in the innermost data-parallel axes (torchtitan's layout)."""
    c = mesh_coords(rank, shape)
    data = (c[MeshAxis.DP] * shape.get(MeshAxis.FSDP, 1) + c[MeshAxis.FSDP]) * shape.get(MeshAxis.CP, 1) + c[MeshAxis.CP]
    return data // ep, data % ep


def expert_groups(shape: dict[MeshAxis, int], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, expert replica groups). An ep group: the ranks that split one set of experts
    between them (same pp and tp coordinates, same replica); a replica group: the ranks holding
    the same experts, whose expert gradients are summed (same pp and ep coordinates: every
    replica and every tp rank)."""
    world = 1
    for a in MESH_ORDER:
        world *= shape.get(a, 1)
    ep_groups: dict[tuple, list[int]] = {}
    replicas: dict[tuple, list[int]] = {}
    for r in range(world):
        c = mesh_coords(r, shape)
        replica, ep_rank = expert_coords(r, shape, ep)
        ep_groups.setdefault((c[MeshAxis.PP], c[MeshAxis.TP], replica), []).append(r)
        replicas.setdefault((c[MeshAxis.PP], ep_rank), []).append(r)
    return list(ep_groups.values()), list(replicas.values())
