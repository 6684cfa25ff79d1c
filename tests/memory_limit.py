"""A memory limit on a whole process tree, for a test: Binder's 2 GB for a kernel and everything it starts.

Preferred: a memory cgroup made for the run (cgroup v2's memory.max under /sys/fs/cgroup, or v1's
memory.limit_in_bytes under /sys/fs/cgroup/memory), which a process enters before it executes and
every descendant inherits, so the sum over the tree is what is limited and the kernel's OOM killer
ends the run that outgrows it. Where no cgroup can be made (not root, read-only /sys/fs/cgroup) it
falls back to per-process limits (`prlimit --data`: each process's data segment and anonymous
mappings), which bound every process alone, not their sum: a weaker check, and `kind` says which.

Knows nothing of notebooks: `wrap(argv)` returns the command that enters the limit then executes
argv (a kernel spec's argv, for one).
"""
from __future__ import annotations

import os
import shlex
import signal
import time
import uuid
from pathlib import Path

CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


class MemoryLimit:
    """`with MemoryLimit(2 * 10**9) as limit: run(limit.wrap(argv))`; then `limit.oom_killed()`."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.path: Path | None = None
        self.kind = "per-process prlimit --data (no writable memory cgroup)"

    def __enter__(self) -> "MemoryLimit":
        name = f"interactive-parallel-test-{uuid.uuid4().hex[:8]}"
        for root, knob, kind in ((CGROUP_V2, "memory.max", "cgroup v2 memory.max"),
                                 (CGROUP_V1, "memory.limit_in_bytes", "cgroup v1 memory.limit_in_bytes")):
            if not (root / "cgroup.procs").exists() or (root is CGROUP_V2 and not (root / "cgroup.controllers").exists()):
                continue
            try:
                (root / name).mkdir()
            except OSError:
                continue
            try:
                (root / name / knob).write_text(str(self.limit))
                swap = root / name / ("memory.swap.max" if root is CGROUP_V2 else "memory.memsw.limit_in_bytes")
                if swap.exists():  # no swapping out of the limit either (v2: swap apart; v1: memory + swap)
                    swap.write_text("0" if root is CGROUP_V2 else str(self.limit))
            except OSError:
                (root / name).rmdir()
                continue
            self.path, self.kind = root / name, kind
            break
        return self

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run inside the limit: the shell enters the cgroup, then becomes argv (exec)."""
        if self.path is None:
            return ["prlimit", f"--data={self.limit}", "--", *argv]
        procs = shlex.quote(str(self.path / "cgroup.procs"))
        return ["/bin/sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]

    def oom_killed(self) -> int:
        """How many processes the OOM killer ended in the cgroup (0 without one)."""
        if self.path is None:
            return 0
        if (self.path / "memory.events").exists():
            text = (self.path / "memory.events").read_text()
        else:
            text = (self.path / "memory.oom_control").read_text()
        fields = dict(line.split() for line in text.splitlines() if line.strip())
        return int(fields.get("oom_kill", 0))

    def peak_bytes(self) -> int | None:
        """The cgroup's peak charge (page cache included), where the kernel keeps one."""
        if self.path is None:
            return None
        for knob in ("memory.peak", "memory.max_usage_in_bytes"):
            if (self.path / knob).exists():
                return int((self.path / knob).read_text())
        return None

    def __exit__(self, *exc) -> None:
        if self.path is None:
            return
        # Whatever the run left behind in the cgroup is ours to end; then the cgroup goes.
        for _ in range(50):
            pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        try:
            self.path.rmdir()
        except OSError:
            pass
