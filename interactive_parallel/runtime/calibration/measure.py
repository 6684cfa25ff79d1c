"""Measuring primitives the calibration shares: a timer that waits for the device, the groups a
mesh makes of the world (made and destroyed on every rank in one order), and a figure one rank
measured handed to its group.

Owns how a time is taken and how a group is had for the length of a measurement. Knows nothing
of what is measured (runtime.calibration.calibrate, runtime.calibration.calibrate_pipeline), of models or of the fit.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ...records.hardware import LinkClass


class Timer:
    """perf_counter readings that wait for the device first (CUDA runs asynchronously)."""

    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def median(self, fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
        """Median seconds of fn() over `repeats` calls after one warm-up; `before` runs untimed
        ahead of each (a barrier keeps the ranks measuring the same thing together)."""
        times = []
        for i in range(repeats + 1):
            if before is not None:
                before()
            t0 = self.now()
            fn()
            t1 = self.now()
            if i:
                times.append(t1 - t0)
        return statistics.median(times)

    def per_call(self, fn: Callable[[], object], repeats: int, batch_s: float) -> float:
        """Median seconds per call of fn() called back to back for at least `batch_s`, every rank
        at once from one barrier, over `repeats` batches. A batch spans several of the OS's time
        slices, so where ranks share cores each call's time holds its share of the waiting, as
        in a step where every rank computes; one lone call would mostly run unshared."""
        dist.barrier()
        fn()
        t0 = self.now()
        fn()
        n = max(1, math.ceil(batch_s / max(self.now() - t0, 1e-7)))
        times = []
        for _ in range(repeats):
            t0 = self.now()
            for _ in range(n):
                fn()
            times.append((self.now() - t0) / n)
        return statistics.median(times)


def layouts(world: int, n: int) -> list[tuple[str, list[list[int]]]]:
    """The groups of `n` ranks a mesh makes of `world`: consecutive ([0, 1], [2, 3]) and strided
    ([0, 2], [1, 3]); one layout when they are the same (n = world)."""
    consecutive = [list(range(i, i + n)) for i in range(0, world, n)]
    strided = [list(range(j, world, world // n)) for j in range(world // n)]
    return [("consecutive", consecutive)] + ([("strided", strided)] if strided != consecutive else [])


def link_class(group: list[int], hosts: list) -> LinkClass:
    """'intra' when every rank of `group` sits on one host, else 'inter'."""
    return "intra" if len({hosts[r] for r in group}) == 1 else "inter"


@contextlib.contextmanager
def my_group(groups: Sequence[list[int]], rank: int) -> Iterator[tuple[list[int], object]]:
    """(this rank's group, its process group) of `groups`, every one made on every rank in one
    order (new_group is collective) and this rank's destroyed afterwards."""
    made = [(g, dist.new_group(g)) for g in groups]
    mine, pg = next((g, p) for g, p in made if rank in g)
    try:
        yield mine, pg
    finally:
        dist.destroy_process_group(pg)


def first_ranks_figure(times: list[float], first: int, pg, device: torch.device) -> float:
    """The median of `times` as the group's rank `first` measured them, on every rank of `pg`
    (the others wait or answer while it times, so only its figure means anything)."""
    figure = torch.tensor([statistics.median(times) if times else 0.0], device=device, dtype=torch.float64)
    dist.broadcast(figure, src=first, group=pg)
    return float(figure.item())
