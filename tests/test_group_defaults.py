"""The defaults a process group's later sub-groups take (runtime.groups.dist.set_group_defaults), read
back from torch's own lookup: gloo's and NCCL's timeouts are both ours, so a DeviceMesh
sub-group on CUDA waits collective_timeout, not NCCL's 10 minutes; NCCL's error handling aborts
and raises instead of killing a waiting peer, and the user's own setting stands."""
import pytest
import torch.distributed.distributed_c10d as c10d

from interactive_parallel.runtime.groups import dist

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


# ---- an NCCL error spoils the rank's state, and its group is aborted (runtime.groups.dist.note_failure) ----

NCCL_TIMEOUT = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, "
                "NumelIn=1, NumelOut=1, Timeout(ms)=5000) ran for 5003 milliseconds before timing out.")
NCCL_REMOTE = "NCCL error in: ProcessGroupNCCL.cpp:2042, remote process exited or there was a network error"


@pytest.fixture
def nccl_rank(monkeypatch):
    """This process as a rank whose backend is NCCL (no group yet): what it notes is forgotten after."""
    from interactive_parallel.runtime.rank import state

    st = state.reset()
    monkeypatch.setattr(st, "backend", "nccl")
    monkeypatch.setattr(dist, "_FAILED", [])
    yield st
    state.reset()


@pytest.mark.parametrize("ename, text, counts", [
    ("DistBackendError", NCCL_TIMEOUT, True), ("RuntimeError", NCCL_REMOTE, True),
    ("DistBackendError", "anything torch's c10d raised", True), ("RuntimeError", "NCCL communicator was aborted", True),
    ("ValueError", "tp(3) does not divide num_attention_heads(4)", False), ("InjectedFault", "injected raise", False)])
def test_nccl_errors_are_told_from_others_by_type_and_text(ename, text, counts):
    assert dist.nccl_failure(ename, text) is counts


def test_a_noted_nccl_error_spoils_the_kept_shards(nccl_rank):
    from torch.distributed import DistBackendError

    from interactive_parallel.runtime.checkpoints.recovery import keep_local

    assert dist.group_failed() == ""
    assert not dist.note_failure(ValueError("bad prompt length"))
    assert dist.note_failure(DistBackendError(NCCL_TIMEOUT))
    assert dist.group_failed().startswith("DistBackendError: [Rank 1] Watchdog caught collective operation timeout")
    nccl_rank.parallel = object()  # a layout is there; keep_local must refuse before reading it
    assert keep_local(nccl_rank) is None and nccl_rank.kept is None


def test_gloo_ranks_note_nothing(nccl_rank):
    nccl_rank.backend = "gloo"
    assert not dist.note_failure(RuntimeError(NCCL_REMOTE)) and dist.group_failed() == ""


def test_a_long_call_that_raises_an_nccl_error_notes_it(nccl_rank):
    from torch.distributed import DistBackendError

    from interactive_parallel.runtime.loop import long_call

    with pytest.raises(DistBackendError):
        with long_call():
            raise DistBackendError(NCCL_REMOTE)
    assert "remote process exited" in dist.group_failed()


def test_a_failed_nccl_group_is_aborted_and_a_sound_one_destroyed(nccl_rank, monkeypatch):
    import torch.distributed as tdist

    calls = []
    real_destroy = tdist.destroy_process_group
    monkeypatch.setattr(c10d, "_abort_process_group", lambda *a: (calls.append("abort"), real_destroy()))
    monkeypatch.setattr(tdist, "destroy_process_group", lambda *a: (calls.append("destroy"), real_destroy()))
    for failed in (False, True):
        store = tdist.HashStore()
        tdist.init_process_group("gloo", store=store, rank=0, world_size=1)
        nccl_rank.backend = "nccl"  # the decision is the backend's name and the noted failure
        if failed:
            dist.note_failure(RuntimeError(NCCL_REMOTE))
        dist.teardown()
        assert not tdist.is_initialized() and dist.group_failed() == ""
    assert calls == ["destroy", "abort"]
