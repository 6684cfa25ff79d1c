"""What keeps a notebook within Binder's memory, checked without a pool: a rank hands its freed heap
back after a call (runtime/rank/heap.py), and the zygote reads the memory limit it runs under and
keeps no standing template below 4 GB (cluster/zygote.py). The notebooks' peaks themselves are
bench/bench_notebook_memory.py's figures (docs/workshops.md); tests/test_binder.py holds the tour
to 2 GB for its whole process tree."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from interactive_parallel.cluster.zygote import KEEP_TEMPLATE_BYTES, keeps_template
from interactive_parallel.runtime.rank.cores import memory_limit
from interactive_parallel.runtime.rank.heap import release_freed
from memory_limit import MemoryLimit

pytestmark = pytest.mark.pure
ROOT = Path(__file__).resolve().parent.parent


def test_freed_heap_goes_back_to_the_os():
    me = psutil.Process()
    junk = [bytes(1000) for _ in range(60_000)]  # 60 MB of malloc'd blocks (too big for Python's own arenas)
    kept = junk[::100]
    grown = me.memory_info().rss
    del junk
    held = me.memory_info().rss  # glibc keeps the freed blocks mapped
    assert release_freed()
    assert me.memory_info().rss < held - 30 * 2**20 and kept, (grown, held, me.memory_info().rss)


def test_the_zygote_keeps_no_template_under_a_small_memory_limit():
    probe = [sys.executable, "-c", "from interactive_parallel.cluster.zygote import keeps_template; "
             "from interactive_parallel.runtime.rank.cores import memory_limit; "
             "print(memory_limit(), keeps_template())"]
    with MemoryLimit(2 * 10**9) as limit:
        if limit.path is None:
            pytest.skip("no writable memory cgroup here: the limit cannot be read back")
        out = subprocess.run(limit.wrap(probe), capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    # the kernel rounds a cgroup v1 limit down to whole pages
    assert 2 * 10**9 - 4096 <= int(out[0]) <= 2 * 10**9 and out[1] == "False", out
    assert (memory_limit() or KEEP_TEMPLATE_BYTES) < KEEP_TEMPLATE_BYTES or keeps_template()
