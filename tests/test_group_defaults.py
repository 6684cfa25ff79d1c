"""The defaults a process group's later sub-groups take (runtime.dist.set_group_defaults), read
back from torch's own lookup: gloo's and NCCL's timeouts are both ours, so a DeviceMesh
sub-group on CUDA waits collective_timeout, not NCCL's 10 minutes; NCCL's error handling aborts
and raises instead of killing a waiting peer, and the user's own setting stands."""
import pytest
import torch.distributed.distributed_c10d as c10d

from interactive_parallel.runtime import dist

pytestmark = pytest.mark.rank1


@pytest.fixture
def defaults(monkeypatch):
    """Torch's module defaults and our record of the environment, restored afterwards."""
    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)
    monkeypatch.setattr(c10d, "default_pg_nccl_timeout", c10d.default_pg_nccl_timeout)
    monkeypatch.setattr(dist, "_OURS", {})
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    return monkeypatch


def test_every_later_group_takes_our_timeout_on_either_backend(defaults):
    timeout = dist.set_group_defaults("nccl", 7.5)
    assert timeout.total_seconds() == 7.5
    assert c10d._get_default_timeout(c10d.Backend("nccl")) == timeout
    assert c10d._get_default_timeout(c10d.Backend("gloo")) == timeout
    import os

    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == dist.NCCL_ERROR_HANDLING == "2"


def test_gloo_leaves_nccls_error_handling_alone_and_the_users_setting_stands(defaults):
    import os

    dist.set_group_defaults("gloo", 3)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    assert c10d._get_default_timeout(c10d.Backend("gloo")).total_seconds() == 3
    defaults.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.set_group_defaults("nccl", 3)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
