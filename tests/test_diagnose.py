"""Failure naming (cluster/diagnose.py) on sample errors, as gloo and the engines word them: pure,
no pool. Each rule of who is named, and how long stragglers may take, checked on its own."""
import pytest

from interactive_parallel.cluster import diagnose
from interactive_parallel.cluster.diagnose import STUCK_MARGIN_S, Evidence, explain
from interactive_parallel.cluster.errors import RankError
from interactive_parallel.records import FaultSpec

pytestmark = pytest.mark.pure

HOSTS = ["h0", "h0", "h1", "h1"]
RESET = "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40123"
TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete"


def err(rank=0, ename="RuntimeError", evalue=RESET, others=None, stuck=None, what="train"):
    return RankError(rank, ename, evalue, "Traceback ...", host=HOSTS[rank], what=what, others=others, stuck=stuck)


def ev(**kw):
    return Evidence(hosts=HOSTS, collective_timeout=5.0, **kw)


def test_a_dead_rank_is_named_over_the_peers_that_lost_it():
    found = explain(err(0, others={1: f"RuntimeError: {RESET}"}, stuck=[2, 3]), ev(dead=[3]))
    e = found.error
    assert (e.rank, e.ename, e.host) == (3, "EngineDied", "h1")
    assert set(e.others) == {0, 1} and e.stuck == [2]
    assert found.patience == 5.0 + STUCK_MARGIN_S


def test_the_rank_still_running_after_its_peers_timed_out_is_named_hung():
    exc = err(0, evalue=TIMEOUT, stuck=[1, 2])
    assert diagnose.wait_for_hung(exc, dead=[])
    found = explain(exc, ev(hung=[2], finished={1: f"RuntimeError: {TIMEOUT[:40]}"}))
    e = found.error
    assert (e.rank, e.ename) == (2, "RankHung") and set(e.others) == {0, 1} and e.stuck == []
    assert found.patience == 0.0  # replaced at once: nobody waits for a hung rank


def test_a_lost_peer_whose_process_lives_is_one_that_gave_up_and_the_hung_rank_is_named():
    """fsdp4 with rank 2 hung: rank 1 times out first and gloo closes its pairs, so rank 0, still
    waiting, sees "Connection closed by peer" before its own timeout; nobody died."""
    exc = err(0, evalue=RESET, stuck=[1, 2, 3])
    assert diagnose.wait_for_hung(exc, dead=[]) and not diagnose.wait_for_hung(exc, dead=[3])
    found = explain(exc, ev(hung=[2], finished={1: f"RuntimeError: {TIMEOUT[:40]}",
                                                3: f"RuntimeError: {RESET[:40]}"}))
    assert (found.error.rank, found.error.ename) == (2, "RankHung") and found.patience == 0.0


def test_when_all_timed_out_together_the_rank_that_skipped_a_collective_is_named():
    skip = FaultSpec(rank=3, fault="skip_collective", time=1.0, detail="at step 1")
    found = explain(err(1, evalue=TIMEOUT, others={0: "RuntimeError: timed out", 3: "RuntimeError: timed out"}),
                    ev(fired=[skip]))
    e = found.error
    assert (e.rank, e.ename) == (3, "SkippedCollective") and 3 not in e.others and set(e.others) == {0, 1}
    assert "skip_collective on rank 3 at step 1" in e.fault
    assert found.patience == STUCK_MARGIN_S


def test_a_plain_error_is_left_as_it_is_and_the_armed_fault_is_named():
    boom = FaultSpec(rank=2, fault="raise")
    found = explain(err(2, ename="ValueError", evalue="bad batch"), ev(armed=[boom]))
    assert (found.error.rank, found.error.ename) == (2, "ValueError")
    assert found.error.fault == "raise on rank 2 at step 0"
    assert not diagnose.group_broken(err(2, ename="ValueError", evalue="bad batch"), left_running=False)


@pytest.mark.parametrize("text, broken", [(RESET, True), (TIMEOUT, True), ("Broken pipe", True),
                                          ("shape mismatch in layer 3", False)])
def test_a_group_is_broken_by_a_timeout_or_a_lost_peer(text, broken):
    assert diagnose.group_broken(err(evalue=text), left_running=False) is broken
    assert diagnose.group_broken(err(evalue=text), left_running=True)


def test_a_dead_controller_is_named_whatever_the_ranks_said():
    found = explain(err(0, ename="EngineDied", evalue="the process of rank 0 is gone"),
                    ev(dead=[0, 1, 2, 3], controller_gone=True, controller_pid=4242))
    e = found.error
    assert e.ename == "ControllerDied" and "pid 4242" in e.evalue and "new pool" in e.evalue
    assert found.patience == 0.0


NCCL_TIMEOUT = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, "
                "NumelIn=1, NumelOut=1, Timeout(ms)=5000) ran for 5003 milliseconds before timing out.")
NCCL_REMOTE = ("NCCL error in: ProcessGroupNCCL.cpp:2042, remote process exited or there was a network error, "
               "NCCL version 2.27.5\nncclRemoteError: A call failed possibly due to a network error or a remote "
               "process exiting prematurely.")
NCCL_ABORTED = "NCCL communicator was aborted on rank 0."


@pytest.mark.parametrize("text, lost, waited", [(NCCL_TIMEOUT, False, True), (NCCL_REMOTE, True, False),
                                               (NCCL_ABORTED, True, False)])
def test_nccls_words_are_read_as_gloos_are(text, lost, waited):
    exc = err(evalue=text)
    assert diagnose.lost_peer(exc) is lost and diagnose.timed_out(exc) is waited
    assert diagnose.group_broken(exc, left_running=False)


def test_a_dead_rank_behind_nccls_remote_error_is_named():
    found = explain(err(0, evalue=NCCL_REMOTE, others={1: f"DistBackendError: {NCCL_ABORTED}"}), ev(dead=[2]))
    assert (found.error.rank, found.error.ename) == (2, "EngineDied") and set(found.error.others) == {0, 1}


def test_a_timeout_says_which_ranks_reached_which_collective_and_where_the_running_rank_is():
    """dp4, rank 1 never issued all_reduce #58 on the world group: 0, 2 and 3 wait in it, rank 1 is
    at #57; rank 2 is still running, blocked in an all_reduce inside a decoder layer's mlp. The two
    'tp' groups of dp2 x tp2 are told apart by their members."""
    from interactive_parallel.records.stacks import CollectiveRecord, FrameRecord, StackRecord, first_mismatch

    def c(rank, seq, state="scheduled", group="world", sizes=((256,),), members=(0, 1, 2, 3), t=None):
        return CollectiveRecord(rank=rank, group=group, seq=seq, op="all_reduce", state=state, ranks=list(members),
                                in_sizes=[list(x) for x in sizes], time=float(seq if t is None else t))

    colls = [c(r, s) for r in range(4) for s in (56, 57)] + [c(r, 58, "started") for r in (0, 2, 3)]
    tp = [c(r, s, group="tp", members=(0, 1) if r < 2 else (2, 3)) for r in range(4) for s in range(1, 4)]
    tp += [c(r, 4, group="tp", members=(0, 1)) for r in (0, 1)]  # one tp group ahead of the other: no mismatch
    found = first_mismatch(colls + tp)
    assert (found.group, found.members, found.seq, found.behind) == ("world", (0, 1, 2, 3), 58, {1: 57})
    assert found.issued == {("all_reduce", "[[256]]", "started"): [0, 2, 3]}
    assert first_mismatch(tp) is None
    # point-to-point ops (pp, ring attention) compared by count: a send and its receive differ by nature
    p2p = [CollectiveRecord(rank=r, group="pp", seq=s, op="send" if r == 0 else "recv", ranks=[0, 2], p2p=True,
                            time=float(s)) for r in (0, 2) for s in range(1, 6 if r == 0 else 5)]
    found = first_mismatch(p2p)
    assert (found.p2p, found.seq, found.behind, list(found.issued.values())) == (True, 5, {2: 4}, [[0]])
    assert first_mismatch([c for c in p2p if c.seq < 5]) is None and "at point-to-point op #5" in found.describe()
    # the skipper's next collective (a 1-element stop vote) took the number its peers wait under: the first
    # number they disagree on is found a few collectives back, and the earliest group's mismatch comes first
    skipped = [c(r, s, sizes=((1,),) if r == 1 and s >= 58 else ((256,),)) for r in range(4) for s in (57, 58, 59)]
    later = [c(r, 9, group="tp", members=(0, 1) if r < 2 else (2, 3), t=100.0) for r in (0, 2, 3)]
    found = first_mismatch(skipped + later)
    assert (found.group, found.seq, found.behind) == ("world", 58, {})
    assert found.issued == {("all_reduce", "[[256]]", "scheduled"): [0, 2, 3], ("all_reduce", "[[1]]", "scheduled"): [1]}
    assert "first mismatch on group 'world' [0, 1, 2, 3] at collective #58: rank(s) [0, 2, 3] issued all_reduce [[256]] " \
        "(scheduled); rank(s) [1] issued all_reduce [[1]] (scheduled)" in diagnose.where_text(skipped, [])
    stack = StackRecord(rank=2, main=True, collective="all_reduce", frames=[
        FrameRecord(file="/x/train.py", line=120, function="forward", module="model.layers.3.mlp"),
        FrameRecord(file="/site-packages/torch/distributed/distributed_c10d.py", line=9, function="all_reduce")])
    found = explain(err(0, evalue=TIMEOUT, others={1: "RuntimeError: timed out", 3: "RuntimeError: timed out"},
                        stuck=[2]), ev(collectives=colls + tp, stacks=[stack]))
    text = str(found.error)
    assert found.error.mismatch.seq == 58 and found.error.mismatch.behind == {1: 57}
    assert found.error.collectives == colls + tp and found.error.stacks == [stack]  # what a figure draws
    assert found.error.with_fault("hang on rank 1").collectives == colls + tp  # kept through every copy
    assert ("first mismatch on group 'world' [0, 1, 2, 3] at collective #58: rank(s) [1] never issued it (latest #57); "
            "rank(s) [0, 2, 3] issued all_reduce [[256]] (started)") in text
    assert "latest on world [0, 1, 2, 3]: rank(s) [0, 2, 3] #58 all_reduce started; rank(s) [1] #57 all_reduce" in text
    assert "latest on tp [0, 1]: rank(s) [0, 1] #4 all_reduce" in text and "latest on tp [2, 3]: rank(s) [2, 3] #3" in text
    assert "rank 2 still running: in all_reduce at train.py:120 in forward [model.layers.3.mlp]" in text
    # without a timeout (a rank raised on its own) nothing is asked or said
    assert "first mismatch" not in str(explain(err(0, "ValueError", "bad"), ev(collectives=colls)).error)


def test_a_number_no_member_holds_is_no_mismatch():
    """Seen serving twice under dp2 x tp2 (notebook 08's question 2): the groups' records skip numbers
    on every rank, and the diagnosis raised ValueError (min of nothing) in place of the rank's error."""
    from interactive_parallel.records.stacks import CollectiveRecord, first_mismatch

    def c(rank, seq):
        return CollectiveRecord(rank=rank, group="tp", seq=seq, op="broadcast", state="completed", ranks=[0, 1],
                                in_sizes=[[3]], time=float(seq))

    assert first_mismatch([c(r, s) for r in (0, 1) for s in (1, 2, 5)]) is None
    found = first_mismatch([c(r, s) for r in (0, 1) for s in (1, 2, 5)] + [c(0, 6)])
    assert (found.seq, found.behind) == (6, {1: 5})
