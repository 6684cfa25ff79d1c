"""How many cores and how much memory this process may use: its CPU affinity capped by its
cgroups' CPU quota, and the machine's memory capped by its cgroups' memory limit. A container
(Binder's, a Kubernetes pod with limits) sees the host's cores and memory but is allowed fewer:
threads or processes sized by the affinity alone there time-slice one core and each runs many
times slower, and a pool sized by the machine's memory is killed by the container's limit.

Owns reading them (cgroup v1 and v2, this process's cgroup and its ancestors). Knows nothing of
ranks, threads or what the cores and memory are used for.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cores() -> int:
    """The cores this process may use, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_quota()
    return max(1, min(cores, quota) if quota is not None else cores)


def cgroup_dirs(controller: str, root: Path = CGROUP, proc: Path = PROC_CGROUP) -> list[tuple[Path, bool]]:
    """(directory, is v2) of this process's cgroup and of each ancestor up to the hierarchy's root,
    in the unified hierarchy (cgroup v2) and in the v1 hierarchy that has `controller` (mounted
    at root/controller): a limit can sit on any of them, and the tightest one holds."""
    try:
        lines = [line.rstrip("\n").split(":", 2) for line in proc.read_text().splitlines()]
    except OSError:
        lines = []
    dirs = []
    for _, controllers, path in (line for line in lines if len(line) == 3):
        if controllers == "":
            base, v2 = root, True
        elif controller in controllers.split(","):
            base, v2 = root / controller, False
        else:
            continue
        parts = [p for p in path.split("/") if p]
        dirs += [(base.joinpath(*parts[:depth]), v2) for depth in range(len(parts), -1, -1)]
    return dirs


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_quota(root: Path = CGROUP, proc: Path = PROC_CGROUP) -> int | None:
    """Whole cores the tightest CPU quota of this process's cgroups allows (rounded up), or None
    where there is none: cgroup v2's cpu.max ('max 100000' or '150000 100000'), v1's cfs quota
    and period."""
    found = []
    for folder, v2 in cgroup_dirs("cpu", root, proc):
        if v2:
            text = (_read(folder / "cpu.max") or "max").split()
            quota, period = (text + ["100000"])[:2]
        else:
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        try:
            q, p = int(quota), int(period)
        except (TypeError, ValueError):  # "max" or an absent file: no quota on this folder
            continue
        if q > 0 and p > 0:
            found.append(math.ceil(q / p))
    return min(found) if found else None


def memory_limit(root: Path = CGROUP, proc: Path = PROC_CGROUP) -> int | None:
    """The tightest memory limit on this process: the machine's memory, its memory cgroup's and
    every ancestor's (cgroup v2 memory.max or v1 memory.limit_in_bytes); None where none reads."""
    found = []
    total = _read(Path("/proc/meminfo"))
    if total is not None:
        found += [int(line.split()[1]) * 1024 for line in total.splitlines() if line.startswith("MemTotal:")]
    for folder, v2 in cgroup_dirs("memory", root, proc):
        text = _read(folder / ("memory.max" if v2 else "memory.limit_in_bytes"))
        if text is not None and text.isdigit() and int(text) < 2**62:  # "max" / v1's near-2**63: no limit
            found.append(int(text))
    return min(found) if found else None
