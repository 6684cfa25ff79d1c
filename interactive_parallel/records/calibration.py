"""The options of a calibration: what the ranks measure, sent from the client to every rank.

Owns `CalibrateOptions` (the matmul shapes and token counts, the precisions, the elementwise
sizes, the collectives' group sizes, ops and byte sizes, the repeats) and the names of the
overlap measurement's three samples, which both the measuring (runtime/calibration/calibrate.py) and the
fit (plan/calibration.py) read. The samples that come back are records.hardware's
CalibrationSample. Knows nothing of torch, of how the figures are measured or fitted, or of
where the shapes come from (plan/calibration.py derives them from a ModelSpec).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from .base import Record

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send", "all_to_all")
"""The collectives a calibration can time, by the names the comm probe and the estimates use
('send' is a send / recv pair between two neighbours, as a pipeline's)."""

OVERLAP_MATMUL, OVERLAP_COLLECTIVE, OVERLAP_BOTH = "overlap_matmul", "overlap_all_reduce", "overlap_both"
"""`op` of the overlap measurement's samples (what='collective'): the compute burst alone, the
all_reduce alone, and the all_reduce started asynchronously before the burst and waited after.
The fit reads them for `overlap` only, never for a link."""
OVERLAP_OPS = (OVERLAP_MATMUL, OVERLAP_COLLECTIVE, OVERLAP_BOTH)


@dataclass(frozen=True)
class CalibrateOptions(Record):
    """What every rank measures, all of them at once, in the same order."""

    kind: ClassVar[str] = "calibrate_options"
    shapes: tuple[tuple[int, int], ...]
    """(in, out) of each linear to time, already at its tensor-parallel local width."""
    tokens: tuple[int, ...]
    """Rows of each timed matmul: the tokens of one micro-step on one rank, under the layouts
    the calibration stands for."""
    burst: tuple[int, int, int]
    """(tokens, in, out) of the matmul every rank computes before each timed collective: the
    compute a collective follows in a step, so the wait for the slowest rank is in its time."""
    precisions: tuple[str, ...] = ("fp32",)
    """'fp32', 'bf16' (autocast), 'fp16' (autocast; CUDA only)."""
    op_sizes: tuple[int, ...] = (256, 4096, 65536, 1 << 20)
    """Elements of each tensor of the timed elementwise add."""
    group_sizes: tuple[int, ...] = ()
    """Collective group sizes (each > 1 dividing the world); empty: every such size."""
    ops: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send")
    """Collectives to time (COLLECTIVE_OPS); 'send' on groups of 2 only."""
    byte_sizes: tuple[int, ...] = (1 << 10, 1 << 14, 1 << 18, 1 << 21)
    """Bytes of each timed collective's full buffer (all_gather's output, reduce_scatter's input)."""
    overlap_bytes: int = 1 << 21
    """Bytes of the all_reduce the overlap measurement hides behind the burst."""
    batch_s: float = 0.01
    """Seconds each timed batch of back-to-back matmuls or adds lasts at least: long enough to
    span several OS time slices, so ranks sharing cores wait in it as they do in a step."""
    repeats: int = 5
    """Timed batches of matmuls or adds, timed calls of a collective (three times as many:
    runtime.calibration.calibrate), per measurement after a warm-up; a sample is their median."""
    rows: int = 0
    """Sequences of the timed training steps of the model with one and with three decoder layers
    (forward, backward, AdamW; the spec rides beside the options): the cost of a block and of
    the rest of a step as the runtime's code pays it; 0: no model steps, and the burst before
    each collective is the matmul `burst`, else the one-layer model's forward and backward."""
    seq_len: int = 0
    """Tokens per sequence of those steps."""
    pipeline: bool = True
    """Time steps of torch's 1F1B schedule over near-empty stages, for every pipeline degree
    dividing the world, pp and 2 pp microbatches (the fixed cost of a pipeline action), and
    bursts of compute with half the ranks waiting (how soon an idle rank's core speeds a busy one)."""

    def __post_init__(self) -> None:
        # from_dict and JSON bring lists; the record is frozen and compared, so tuples throughout.
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):
                v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
                object.__setattr__(self, f.name, v)

    def problems(self, world_size: int) -> list[str]:
        """Why these options cannot run on `world_size` ranks (empty: they can), every reason at once."""
        out = []
        if not self.shapes:
            out.append("no matmul shapes to time")
        if not self.tokens or min(self.tokens) < 1:
            out.append(f"tokens {self.tokens}: need at least one count >= 1")
        if min(self.burst) < 1:
            out.append(f"burst {self.burst}: every dimension must be >= 1")
        if not self.batch_s > 0:
            out.append(f"batch_s({self.batch_s}) must be > 0")
        if self.repeats < 1:
            out.append(f"repeats({self.repeats}) < 1")
        unknown = [op for op in self.ops if op not in COLLECTIVE_OPS]
        if unknown:
            out.append(f"unknown collectives {unknown}: choose from {list(COLLECTIVE_OPS)}")
        bad = [n for n in self.group_sizes if n < 2 or world_size % n]
        if bad:
            out.append(f"group sizes {bad} are not > 1 and dividing the world ({world_size})")
        too_small = [b for b in self.byte_sizes if b < 4 * world_size]
        if too_small:
            out.append(f"byte sizes {too_small} < 4 bytes per rank of {world_size}")
        return out
