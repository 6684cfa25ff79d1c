"""A zygote whose imports initialised CUDA forks no engine (a forked child's CUDA calls would
fail): the local pool sees the zygote's refusal and starts its engines with ipyparallel's own
launcher instead, with a warning, and stops as cleanly as ever. CUDA cannot be initialised on
this CPU machine, so a sitecustomize on the zygote's path sets torch's own flag the way its
lazy init would; the engines of the fallback start without it."""
from __future__ import annotations

import os

import pytest

from conftest import assert_gone
from interactive_parallel.cluster.pool import LocalPool
from interactive_parallel.cluster.zygote import CUDA_TOUCHED

pytestmark = pytest.mark.session

SITECUSTOMIZE = '''
import sys
if "interactive_parallel.cluster.zygote" in sys.orig_argv:
    import torch.cuda
    torch.cuda._initialized = True  # what torch's lazy init leaves behind
'''


def test_engines_start_without_the_fork_when_the_zygote_finds_cuda_initialised(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.warns(UserWarning, match="cannot be forked .* initialised CUDA before the fork"):
        pool = LocalPool(2, timeout=90, launch="fork")
    try:
        assert pool.launch == "warm"
        assert pool._zygotes[0].poll() == CUDA_TOUCHED
        assert len(pool.engine_ids) == 2
        assert sorted(pool.client[:].apply_sync(os.getpid)) == sorted(pool.engine_pids())
        pids = pool.process_tree()
    finally:
        pool.stop()
    assert_gone(pids, [])
