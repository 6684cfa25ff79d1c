"""The spawned-group harness the multirank tests stand on (tests/mp_harness.py): a rank's
exception is named with its traceback and never retried; a rank that dies of a native crash is
named before its peer's connection error, and the group runs once more with a warning (a crash
both times fails, naming the rank). The rank bodies live here, at module level, so the spawned
ranks can import them."""
from __future__ import annotations

import os

import pytest

from mp_harness import RankCrashed, RankFailure, run_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(autouse=True)
def _own_reruns():
    """The crashes here are on purpose: the suite's count of reruns leaves them out."""
    import mp_harness

    before = list(mp_harness.RERUNS)
    yield
    mp_harness.RERUNS[:] = before


def _runs(counter: str) -> int:
    """How many times rank 1 has started this group (a line per start)."""
    return len(open(counter).read().splitlines()) if os.path.exists(counter) else 0


def _body(rank: int, counter: str, fault: str, times: int) -> int:
    """Both ranks all-reduce once; rank 1 first raises or crashes in the group's first `times` runs."""
    import torch
    import torch.distributed as dist

    if rank == 1:
        with open(counter, "a") as f:
            f.write("start\n")
        if _runs(counter) <= times:
            if fault == "raise":
                raise ValueError("a test fault on rank 1")
            import ctypes

            ctypes.string_at(0)  # a read of address 0: SIGSEGV, as a fault in native code would
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)  # rank 0 waits here for a peer that is gone: its error is the consequence
    return int(t.item())


def test_a_rank_that_raises_is_named_with_its_traceback_and_not_run_again(tmp_path):
    counter = str(tmp_path / "runs")
    with pytest.raises(RankFailure) as exc:
        run_ranks(_body, 2, counter, "raise", 9, timeout_s=60, collective_timeout_s=10)
    assert not isinstance(exc.value, RankCrashed)
    assert "rank 1 raised" in str(exc.value) and "ValueError: a test fault on rank 1" in str(exc.value)
    assert _runs(counter) == 1


def test_a_native_crash_is_named_first_and_the_group_runs_once_more(tmp_path):
    counter = str(tmp_path / "runs")
    with pytest.warns(RuntimeWarning, match="rank 1 died of SIGSEGV: the group of _body runs once more"):
        out = run_ranks(_body, 2, counter, "crash", 1, timeout_s=60, collective_timeout_s=10)
    assert out == [3, 3] and _runs(counter) == 2


def test_a_crash_in_both_runs_fails_naming_the_rank(tmp_path):
    counter = str(tmp_path / "runs")
    with pytest.warns(RuntimeWarning, match="rank 1 died of SIGSEGV"), pytest.raises(RankCrashed) as exc:
        run_ranks(_body, 2, counter, "crash", 9, timeout_s=60, collective_timeout_s=10)
    assert str(exc.value).startswith("rank 1 died of SIGSEGV") and _runs(counter) == 2
