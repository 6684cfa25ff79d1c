"""GPU assignment across re-forms (cluster.rendezvous.assign): under CUDA each engine is pinned
to the GPU it was first given, so after a replacement a survivor computes where its CUDA
context and cached memory already are, and the replacement takes the GPU the dead rank freed,
even when engine-id order would now give it another one. Also the order itself: a launcher's
numbering (SLURM_PROCID, the MPI rank) orders ranks and hosts where every engine has one, and
ranks of different torch builds are refused naming the host."""
import pytest

from interactive_parallel.cluster import rendezvous
from interactive_parallel.cluster.errors import SessionError
from interactive_parallel.records import RankFacts

pytestmark = pytest.mark.pure


def facts(hosts: list[str], gpus: int = 4) -> list[RankFacts]:
    return [RankFacts(host=h, pid=100 + i, cores=4, cuda=gpus) for i, h in enumerate(hosts)]


def gpus_of(places) -> dict[int, int]:
    return {p.engine_id: p.gpu for p in places}


def test_first_assignment_gives_local_ranks_their_gpus_and_cpu_none():
    places = rendezvous.assign([3, 1, 2, 0], facts(["a", "a", "b", "b"]), "cuda")
    assert [(p.engine_id, p.host, p.local_rank, p.gpu) for p in places] == [
        (1, "a", 0, 0), (3, "a", 1, 1), (0, "b", 0, 0), (2, "b", 1, 1)]
    assert {p.gpu for p in rendezvous.assign([0, 1], facts(["a", "a"]), "cpu")} == {-1}


def test_survivors_keep_their_gpu_and_a_replacement_takes_the_freed_one():
    first = rendezvous.assign([0, 1, 2, 3], facts(["a"] * 4), "cuda")
    assert gpus_of(first) == {0: 0, 1: 1, 2: 2, 3: 3}
    # engine 1 died; its replacement has the highest id, so by id order engines 2 and 3 would
    # move down to GPUs 1 and 2 and the new one would land on GPU 3, still held by engine 3.
    again = rendezvous.assign([0, 2, 3, 4], facts(["a"] * 4), "cuda", gpus_of(first))
    assert gpus_of(again) == {0: 0, 2: 2, 3: 3, 4: 1}
    assert [p.local_rank for p in again] == [0, 1, 2, 3]
    assert len({p.gpu for p in again}) == 4


def test_pins_are_per_host_and_a_pin_out_of_range_or_taken_twice_is_reassigned():
    first = rendezvous.assign([0, 1, 2, 3], facts(["a", "a", "b", "b"], gpus=2), "cuda")
    pinned = gpus_of(first) | {9: 1}  # a stale pin naming GPU 1 of host b, already engine 3's
    again = rendezvous.assign([0, 1, 3, 9], facts(["a", "a", "b", "b"], gpus=2), "cuda", pinned)
    assert gpus_of(again) == {0: 0, 1: 1, 3: 1, 9: 0}
    shrunk = rendezvous.assign([0, 1], facts(["a", "a"], gpus=2), "cuda", {0: 5, 1: 0})
    assert gpus_of(shrunk) == {0: 1, 1: 0}


def test_more_local_ranks_than_gpus_is_refused_before_any_pin():
    with pytest.raises(SessionError, match="one GPU per local rank needed; a: 3 ranks > 2 GPUs"):
        rendezvous.assign([0, 1, 2], facts(["a"] * 3, gpus=2), "cuda", {0: 0})


def test_a_launchers_numbering_orders_the_ranks_and_hosts():
    """Engine ids follow registration; srun's SLURM_PROCID (or the MPI rank) is what the user
    launched: hosts in the order of their lowest launcher rank, launcher ranks within a host."""
    fs = [RankFacts(host=h, pid=100 + i, cores=4, cuda=0, launcher_rank=r)
          for i, (h, r) in enumerate([("b", 3), ("a", 1), ("b", 2), ("a", 0)])]
    places = rendezvous.assign([0, 1, 2, 3], fs, "cpu")
    assert [(p.rank, p.host, p.launcher_rank, p.local_rank) for p in places] == [
        (0, "a", 0, 0), (1, "a", 1, 1), (2, "b", 2, 0), (3, "b", 3, 1)]


def test_ranks_of_different_torch_builds_are_refused_naming_the_host():
    fs = [RankFacts(host=h, pid=i, cores=1, cuda=0, torch=v)
          for i, (h, v) in enumerate([("host1", "2.13.0"), ("host1", "2.13.0"), ("host2", "2.13.0"), ("host3", "2.12.0")])]
    with pytest.raises(SessionError) as e:
        rendezvous.assign([0, 1, 2, 3], fs, "cpu")
    assert str(e.value).startswith("torch differs across hosts: host3 has torch 2.12.0; host1, host2 have torch 2.13.0")
