"""How many cores this process may keep busy: its CPU affinity, capped by its cgroup's CPU
quota. A container (Binder's, a Kubernetes pod with a CPU limit) sees the host's cores in its
affinity but is allowed fewer: threads or processes sized by the affinity alone there time-slice
one core and each runs many times slower.

Owns reading the two. Knows nothing of ranks, threads or what the cores are used for.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """The cores this process may use, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_quota()
    return max(1, min(cores, quota) if quota is not None else cores)


def cgroup_quota(root: Path = CGROUP) -> int | None:
    """Whole cores the cgroup's CPU quota allows (rounded up), or None where there is none:
    cgroup v2's cpu.max ('max 100000' or '150000 100000'), else v1's cfs quota and period."""
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return math.ceil(int(text[0]) / int(text[1]))
        if text:
            return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return math.ceil(quota / period) if quota > 0 and period > 0 else None
