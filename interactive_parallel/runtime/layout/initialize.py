"""Fill the local shards of a model built on the meta device: seeded, plan-independent weights.

Owns the values a rank writes into the storage `to_empty` gave it, and nothing about
where that storage sits (runtime.layout.pieces says which index ranges of each logical tensor
this rank holds). Every element of a parameter is a function of (plan seed, parameter
name, its position), never of the layout: a parameter is cut into fixed tiles (TILE rows
x columns of its logical 2-D shape) and each tile is drawn from a generator seeded by
(seed, name, tile row, tile column); a rank draws only the tiles its pieces overlap, so
its peak is one tile, not one tensor, and every plan (and the one-process reference)
sees the same weights. The distributions are the model's own `_init_weights` rules
(transformers' PreTrainedModel): linears and embeddings normal(0, initializer_range),
an embedding's padding row zero, norms ones (or zeros where the norm scales by
1 + weight: FamilyInfo.norm_init) and zeros, biases zeros, and the block
linears a family scales by 1/sqrt(2 x layers) (FamilyInfo.scaled_init: GPT-2's c_proj).
The draws themselves differ from transformers' (one generator per tile, not one stream
for the model), which only matters to someone comparing with `from_config` bit by bit.

A model given as a local directory is read slice by slice instead: safetensors
`get_slice` (or an mmap'ed torch file) for exactly the ranges this rank holds.
Buffers (Llama's rotary `inv_freq`, Gemma's embedding scale) are recomputed by the model's own
`_init_weights`.
Knows nothing of meshes, plans or parallel styles beyond what runtime.layout.pieces gives.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Callable

import torch
from torch import nn

from .pieces import Piece, pieces

TILE = (256, 1024)
"""Rows x columns of one seeded tile (1 MiB of fp32): the peak extra memory of a fill."""


def tile_seed(seed: int, name: str, row: int, col: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{row}:{col}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _as_2d(piece: Piece, shape: tuple[int, ...]) -> tuple[torch.Tensor, int, int, int, int]:
    """(2-D view, row offset, col offset, rows, cols) of a piece of a logical tensor. Beyond two
    dims (stacked experts: [experts, out, in]) the leading dims fold into rows, which needs a
    piece cut on dim 0 only (expert parallelism and FSDP cut there)."""
    if len(shape) == 1:
        return piece.view.unsqueeze(0), 0, piece.offsets[0], 1, shape[0]
    if len(shape) > 2:
        if any(piece.offsets[1:]) or tuple(piece.view.shape[1:]) != tuple(shape[1:]):
            raise ValueError(f"seeded init of a {len(shape)}-D tensor needs pieces cut on dim 0 only, not "
                             f"{tuple(piece.view.shape)} at {piece.offsets} of {tuple(shape)}")
        inner = math.prod(shape[1:-1])
        return (piece.view.view(-1, shape[-1]), piece.offsets[0] * inner, 0, shape[0] * inner, shape[-1])
    return piece.view, piece.offsets[0], piece.offsets[1], shape[0], shape[1]


def fill_normal(piece: Piece, shape: tuple[int, ...], std: float, seed: int, name: str) -> None:
    """Write normal(0, std) draws of the tiles that `piece` overlaps into it."""
    view, r0, c0, rows, cols = _as_2d(piece, shape)
    r1, c1 = r0 + view.shape[0], c0 + view.shape[1]
    tr, tc = TILE
    for ti in range(r0 // tr, (r1 - 1) // tr + 1 if r1 > r0 else 0):
        a0, a1 = ti * tr, min((ti + 1) * tr, rows)
        for tj in range(c0 // tc, (c1 - 1) // tc + 1 if c1 > c0 else 0):
            b0, b1 = tj * tc, min((tj + 1) * tc, cols)
            gen = torch.Generator().manual_seed(tile_seed(seed, name, ti, tj))
            # Drawn on the CPU whatever the device: the same numbers on every device and in the reference.
            tile = torch.empty(a1 - a0, b1 - b0, device="cpu").normal_(0.0, std, generator=gen)  # [tile rows, cols]
            lo_r, hi_r, lo_c, hi_c = max(r0, a0), min(r1, a1), max(c0, b0), min(c1, b1)
            view[lo_r - r0:hi_r - r0, lo_c - c0:hi_c - c0].copy_(tile[lo_r - a0:hi_r - a0, lo_c - b0:hi_c - b0])


def _rule(raw: nn.Module, name: str, spec) -> Callable[[Piece, tuple[int, ...], int], None]:
    """How the model's own `_init_weights` initializes parameter `name` (as a piece filler)."""
    path, _, leaf = name.rpartition(".")
    module = raw.get_submodule(path)
    std = float(getattr(raw.config, "initializer_range", 0.02) or 0.02)
    if isinstance(module, nn.Embedding):
        pad = module.padding_idx

        def embedding(piece: Piece, shape, seed: int) -> None:
            fill_normal(piece, shape, std, seed, name)
            row = (pad if pad is not None else -1) - piece.offsets[0]
            if 0 <= row < piece.view.shape[0]:
                piece.view[row].zero_()
        return embedding
    if "Norm" in type(module).__name__:
        value = spec.family_info.norm_init if leaf == "weight" else 0.0
        return lambda piece, shape, seed: piece.view.fill_(value)
    if leaf == "bias" or leaf.endswith("_bias"):
        return lambda piece, shape, seed: piece.view.zero_()
    if getattr(module, leaf).dim() >= 3:  # stacked expert weights: normal, as their _init_weights draws them
        return lambda piece, shape, seed: fill_normal(piece, shape, std, seed, name)
    if leaf == "weight" and len(module.weight.shape) >= 2:
        fam = spec.family_info
        block = f"{fam.layers_path}."
        rel = path[len(block):].partition(".")[2] if path.startswith(block) else ""
        scale = 1.0 / math.sqrt(2 * spec.num_layers) if rel in fam.scaled_init else 1.0
        return lambda piece, shape, seed: fill_normal(piece, shape, std * scale, seed, name)
    raise ValueError(f"no initialization rule for {name} ({type(module).__name__}.{leaf})")


def owned_parameters(par) -> dict[str, torch.Tensor]:
    """Canonical name -> parameter, for the parameters this rank holds.

    Canonical (Parallelized.canonical): a tied weight's first name (the embedding's), also on
    a rank that holds it only as the LM head, so every holder draws the same values.
    """
    owned = set(par.owned_keys())
    out: dict[str, torch.Tensor] = {}
    for name, p in par.raw.named_parameters(remove_duplicate=False):
        if name in owned:
            out.setdefault(par.canonical(name), p)
    return out


@torch.no_grad()
def init_seeded(par) -> None:
    """Every local shard from the plan's seed (see the module docstring)."""
    for name, p in owned_parameters(par).items():
        rule = _rule(par.raw, name, par.spec)
        for piece in pieces(p, par.perms.get(name)):
            rule(piece, tuple(p.shape), par.plan.seed)


@torch.no_grad()
def init_from_state(par, state_dict: dict[str, torch.Tensor]) -> None:
    """Every local shard cut from full tensors (`state_dict`, under the model's names)."""
    aliases = {v: k for k, v in par.aliases.items()}
    for name, p in owned_parameters(par).items():
        full = state_dict[name] if name in state_dict else state_dict[aliases[name]]
        for piece in pieces(p, par.perms.get(name)):
            piece.view.copy_(full[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))])


@torch.no_grad()
def init_buffers(par, roots: list[nn.Module]) -> None:
    """Buffers left garbage by to_empty, recomputed by the model's own `_init_weights`
    (rotary tables; Gemma's embedding scale). A module that also holds parameters has them
    stood in for by meta tensors meanwhile: `_init_weights` would draw over its shards."""
    for root in roots:
        for module in root.modules():
            if not any(True for _ in module.buffers(recurse=False)):
                continue
            held = dict(module._parameters)
            module._parameters.update({k: nn.Parameter(torch.empty(p.shape, device="meta"), requires_grad=False)
                                       for k, p in held.items() if p is not None})
            try:
                par.raw._init_weights(module)
            finally:
                module._parameters.update(held)


class SourceReader:
    """Slices of the tensors in a local transformers model directory (safetensors or torch files)."""

    def __init__(self, folder: str, prefix: str):
        self.folder, self.prefix = folder, prefix
        self.files: dict[str, str] = {}
        index = [f for f in os.listdir(folder) if f.endswith(".index.json")]
        if index:
            with open(os.path.join(folder, index[0])) as f:
                self.files = {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            for fname in sorted(os.listdir(folder)):
                if fname.endswith((".safetensors", ".bin")):
                    for key in self._keys(os.path.join(folder, fname)):
                        self.files[key] = os.path.join(folder, fname)
        self._open: dict[str, object] = {}

    @staticmethod
    def _keys(path: str) -> list[str]:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                return list(f.keys())
        return list(torch.load(path, map_location="cpu", mmap=True, weights_only=True).keys())

    def key(self, name: str) -> str:
        """The file's key for a parameter name (base models are saved without the head's prefix)."""
        stripped = name[len(self.prefix) + 1:] if name.startswith(self.prefix + ".") else None
        for candidate in (name, stripped, f"{self.prefix}.{name}"):
            if candidate in self.files:
                return candidate
        raise KeyError(f"{name} is not in the model files of {self.folder}")

    def read(self, name: str, piece: Piece) -> torch.Tensor:
        key = self.key(name)
        path = self.files[key]
        index = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            if path not in self._open:
                self._open[path] = safe_open(path, framework="pt")
            return self._open[path].get_slice(key)[index]
        if path not in self._open:
            self._open[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self._open[path][key][index]


@torch.no_grad()
def init_from_source(par) -> None:
    """Every local shard read from the spec's local directory, only the ranges this rank holds."""
    reader = SourceReader(par.spec.source, par.raw.base_model_prefix)
    for name, p in owned_parameters(par).items():
        for piece in pieces(p, par.perms.get(name)):
            piece.view.copy_(reader.read(name, piece))
