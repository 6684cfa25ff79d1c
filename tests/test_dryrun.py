"""The dry run (runtime/client/dryrun.py): the runtime's own layout and training step on fake tensors
and torch's fake process group, in this process.

Oracles: a live run of the same plan on spawned gloo ranks (memory exactly; the same
collectives with the same bytes, dtypes, axes, groups and peers, and the same causes; the same
layout), for every parity plan of tests/test_parallel_parity.py; and the dry run that simulates every rank
against the one that simulates one rank per class and moves the records (equal). Bad input
is refused with its numbers before any process group exists.
"""
from __future__ import annotations

import collections
import math

import pytest

from interactive_parallel import Plan, PlanError
from interactive_parallel.plan import PRESETS, UnknownModelError
from interactive_parallel.records import CommRecord, MemoryRecord, ShardRecord
from conftest import parity_plan_params
from test_lint import assert_implicit_redistributes_predicted


def _comm_key(c: CommRecord) -> tuple:
    return (c.op, c.bytes, c.dtype, c.axis, tuple(c.group), c.peer, c.module, c.needed_by, c.placements, c.implicit,
            c.phase)


def _per_rank(comms) -> dict[int, collections.Counter]:
    out: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for c in comms:
        out[c.rank][_comm_key(c)] += 1
    return dict(out)


def _shard_key(s: ShardRecord) -> tuple:
    return (s.param, s.rank, tuple(s.global_shape), tuple(s.local_shape), tuple(s.placements),
            tuple(s.mesh_axes), tuple(sorted(s.coords.items())), tuple(map(tuple, s.index)), s.stage)


# ---------------------------------------------------------------- refused before any work

@pytest.mark.pure
@pytest.mark.parametrize("model,plan,world,message", [
    ("tiny-llama", Plan(tp=3, batch_size=8), 3, "tp(3) does not divide num_attention_heads(4)"),
    ({**PRESETS["tiny-llama"].config, "num_key_value_heads": 2}, Plan(tp=4), 4,
     "tp(4) does not divide num_key_value_heads(2)"),
    ("tiny-llama", Plan(pp=8, batch_size=8), 8, "num_hidden_layers(4) < pipeline stages pp(8)"),
    ("llama-3-70b", Plan(dp=16, pp=8, tp=8, batch_size=128), 512, "dp(16) * tp(8) * pp(8) = 1024 != ranks(512)"),
])
def test_bad_plans_refused_with_their_numbers(model, plan, world, message):
    import sys

    from interactive_parallel import dry_run

    before = set(sys.modules)
    with pytest.raises(PlanError) as err:
        dry_run(model, plan, world)
    assert message in str(err.value)
    assert "torch" not in set(sys.modules) - before or "torch" in before  # refused before any work


@pytest.mark.pure
def test_unknown_config_refused_naming_what_is_known(tmp_path):
    from interactive_parallel import dry_run

    with pytest.raises(UnknownModelError, match="llama-3-70b"):
        dry_run(str(tmp_path / "nowhere.json"), Plan(dp=2), 2)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "bert", "vocab_size": 10}')
    with pytest.raises(UnknownModelError, match="BertConfig ships no TP and PP plan"):
        dry_run(str(bad), Plan(dp=2), 2)


# ---------------------------------------------------------------- one rank per class

CLASS_PLANS = [
    pytest.param("tiny-llama", dict(dp=2, tp=2, pp=2, microbatches=2), id="dp2xtp2xpp2"),
    pytest.param({**PRESETS["tiny-llama"].config, "vocab_size": 130}, dict(fsdp=4, batch_size=8), id="fsdp4-uneven"),
    pytest.param("tiny-gpt2", dict(pp=2, tp=2, sequence_parallel=True), id="gpt2-pp2xtp2-sp"),
    pytest.param("tiny-llama", dict(pp=2, pp_schedule="interleaved-1f1b", dp=2), id="pp2-interleaved-dp2"),
    pytest.param("tiny-llama", dict(pp=2, pp_schedule="zbv", fsdp=2), id="pp2-zbv-fsdp2"),
    pytest.param("tiny-llama", dict(dp=2, cp=2, fsdp=2), id="dp2xfsdp2xcp2"),
    pytest.param("tiny-llama", dict(dp=2, cp=2, cp_method="ring"), id="dp2xcp2-ring"),
    pytest.param("tiny-llama", dict(pp=2, dp=2, stage_layers=(1, 3)), id="pp2-stages-1-3-dp2"),
    pytest.param({**PRESETS["tiny-llama"].config, "num_hidden_layers": 3}, dict(pp=2, dp=2), id="pp2-3-layers-dp2"),
]


@pytest.mark.rank1
@pytest.mark.parametrize("model,fields", CLASS_PLANS)
def test_classes_moved_equal_every_rank_simulated(model, fields):
    from interactive_parallel import dry_run

    plan = Plan(**{"batch_size": 8, "seq_len": 32, **fields})
    every, classes = dry_run(model, plan, exhaustive=True), dry_run(model, plan)
    assert len(classes.simulated) < plan.world_size == len(every.simulated)
    assert list(classes.memory()) == list(every.memory())
    assert _per_rank(classes.comms()) == _per_rank(every.comms())
    for rank in range(plan.world_size):
        assert sorted(map(_shard_key, classes.layout(rank=rank))) == sorted(map(_shard_key, every.layout(rank=rank)))


@pytest.mark.rank1
def test_representatives_simulated_in_forked_processes_equal_those_simulated_here(monkeypatch):
    """runtime/client/forked.py shares the representatives out over forks of this process: the
    records are the same wherever a representative ran, and the warnings it raised reach here."""
    from dataclasses import replace

    from interactive_parallel import dry_run

    plan = Plan(dp=2, tp=2, pp=2, microbatches=2, batch_size=8, seq_len=32)
    monkeypatch.setenv("IP_DRY_RUN_PROCESSES", "1")
    here = dry_run("tiny-llama", plan)
    monkeypatch.setenv("IP_DRY_RUN_PROCESSES", "3")  # more than the representatives: one each
    forked = dry_run("tiny-llama", plan)
    assert sorted(here.simulated) == sorted(forked.simulated) and len(here.simulated) == 2
    for rep, sim in here.simulated.items():  # all but when things happened
        other = forked.simulated[rep]
        assert _per_rank(other.comms) == _per_rank(sim.comms) and len(sim.comms) > 0
        assert replace(other, comms=[], step=None, seconds=0.0) == replace(sim, comms=[], step=None, seconds=0.0)
        clock = {"time_s", "start", "end", "phases", "compute_s", "comm_s", "idle_s"}
        assert (repr({k: v for k, v in vars(other.step).items() if k not in clock})  # repr: a fake loss is nan
                == repr({k: v for k, v in vars(sim.step).items() if k not in clock}))


def _square(x: int) -> int:
    import os
    import warnings

    if x == 3:
        raise ValueError(f"three is refused in pid {os.getpid()}")
    if x == 4:
        os._exit(7)
    warnings.warn(f"squared {x}", UserWarning)
    return x * x


@pytest.mark.rank1  # forks this process
def test_forked_share_returns_results_warnings_and_names_a_failure(monkeypatch):
    import os
    import warnings

    from interactive_parallel.runtime.client.forked import ForkedError, map_forked

    def children() -> set[str]:  # this process's children (the suite's pools included), zombies too
        me = os.getpid()
        return set(open(f"/proc/{me}/task/{me}/children").read().split())

    before = children()
    monkeypatch.setenv("IP_DRY_RUN_PROCESSES", "2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert map_forked(_square, [1, 2, 5, 6]) == {1: 1, 2: 4, 5: 25, 6: 36}
    assert sorted(str(w.message) for w in caught) == ["squared 1", "squared 2", "squared 5", "squared 6"]
    warnings.simplefilter("ignore", UserWarning)  # the squares below warn too (pytest restores the filters)
    with pytest.raises(ValueError, match="three is refused") as raised:  # raised in the child: its own type
        map_forked(_square, [1, 3], what="number")
    assert f"pid {os.getpid()}" not in str(raised.value)
    assert any("raised in the forked process simulating numbers [3]" in n for n in raised.value.__notes__)
    with pytest.raises(ForkedError, match=r"simulating numbers \[4\] .* died \(exit code 7\)"):
        map_forked(_square, [1, 4], what="number")
    assert children() == before  # every fork reaped


@pytest.mark.pure
def test_uneven_fsdp_shards_make_their_own_class():
    from interactive_parallel.plan.models import resolve_model
    from interactive_parallel.plan.virtual import move, rank_classes

    odd = {**PRESETS["tiny-llama"].config, "vocab_size": 130}  # 130 rows over 4: 33, 33, 33, 31
    assert rank_classes(resolve_model(odd), Plan(fsdp=4)) == {0: 0, 1: 0, 2: 0, 3: 3}
    plan = Plan(pp=2, dp=2, tp=2)  # ranks: pp-major, tp innermost
    assert rank_classes(PRESETS["tiny-llama"], plan) == {r: 0 if r < 4 else 4 for r in range(8)}
    assert move([0, 1], 0, 3, plan) == [2, 3]  # rank 0's tp group, as rank 3 sees it
    assert move([0, 2], 0, 3, plan) == [1, 3]  # its dp group
    assert move([0, 4], 0, 3, plan) == [3, 7]  # a pipeline peer


@pytest.mark.rank1
def test_a_parameter_across_every_rank_tiles_the_whole_tensor():
    from interactive_parallel import dry_run

    d = dry_run("tiny-llama", Plan(fsdp=2, tp=2, pp=2, batch_size=8, seq_len=32))
    name = "model.layers.3.mlp.down_proj.weight"  # on stage 1: ranks 4-7
    shards = d.layout(param=name)
    assert sorted(s.rank for s in shards) == [4, 5, 6, 7] and all(s.stage == 1 for s in shards)
    covered = collections.Counter()
    for s in shards:
        (r0, r1), (c0, c1) = s.index
        assert [r1 - r0, c1 - c0] == s.local_shape
        covered.update((r, c) for r in range(r0, r1) for c in range(c0, c1))
    rows, cols = shards[0].global_shape
    assert len(covered) == rows * cols and set(covered.values()) == {1}  # each element exactly once
    with pytest.raises(KeyError, match="no rank holds"):
        d.layout(param="no.such.weight")


@pytest.mark.rank1
@pytest.mark.parametrize("model,head", [("tiny-llama", "lm_head.weight"), ("tiny-gpt2", None)])
def test_tp_splits_the_embedding_and_head_on_the_vocabulary(model, head):
    """The layout view's records: each tp rank holds its half of the vocabulary rows of the token
    embedding and the LM head (GPT-2's tied pair: one weight, split once), with loss parallel or
    without; Plan(vocab_parallel=False) keeps both whole on every tp rank. (tests/test_dryrun's
    live comparison holds these records equal to a live run's.)"""
    from interactive_parallel import dry_run

    embed = PRESETS[model].family_info.embedding_path + ".weight"
    for fields, rows in ((dict(loss_parallel=True), [[0, 64], [64, 128]]), ({}, [[0, 64], [64, 128]]),
                         (dict(vocab_parallel=False), [[0, 128], [0, 128]])):
        d = dry_run(model, Plan(tp=2, batch_size=4, seq_len=16, **fields))
        split = Plan(tp=2, **fields).vocab_split
        for name in filter(None, (embed, head)):
            shards = sorted(d.layout(param=name), key=lambda s: s.rank)
            assert [s.index[0] for s in shards] == rows, (fields, name)
            if split:
                assert all(s.placements == ["Shard(dim=0)"] and s.mesh_axes == ["tp"] for s in shards), name
        names = {s.param for s in d.layout(rank=0)}
        assert (head in names) if head else ("lm_head.weight" not in names)


@pytest.mark.rank1
def test_shipped_config_on_a_mesh_larger_than_this_machine():
    """Llama-3-8B's shape over 64 virtual ranks: a few seconds, no weights."""
    from interactive_parallel import dry_run
    from interactive_parallel.plan.estimate import predict_memory

    plan = Plan(dp=4, pp=4, tp=4, batch_size=16, seq_len=64, precision="bf16")
    d = dry_run("llama-3-8b", plan)
    mem = d.memory()
    assert len(mem) == 64 and all(isinstance(m, MemoryRecord) for m in mem)
    assert sum(m.params for m in mem[:16:4]) * 4 > 8e9 * 4  # 4 stages x tp 4 hold every fp32 weight
    predicted = predict_memory(d.spec, plan)
    for m, p in zip(mem, predicted):
        assert (m.params, m.grads, m.optimizer) == (p.params, p.grads, p.optimizer)
        assert math.isclose(m.activations, p.activations, rel_tol=0.10)
    axes = {c.axis for c in d.comms(0)}
    assert {"tp", "pp", "dp"} <= axes
    assert d.plan.world_size == 64 and len(d.simulated) == 4


# ---------------------------------------------------------------- against a live run (conftest.parity_steps)

@pytest.mark.multirank
@pytest.mark.parametrize("label,precision", parity_plan_params())
def test_dry_run_records_equal_a_live_run(parity_steps, label, precision):
    from test_parallel_parity import ALL

    from interactive_parallel import dry_run

    preset, fields = ALL[label]
    d = dry_run(preset, Plan(**fields, precision=precision))
    got = parity_steps[label, precision]
    for rank, (memory, comms, shards) in got.items():
        dry = d.memory()[rank]
        assert (dry.params, dry.grads, dry.optimizer, dry.activations) == \
            (memory.params, memory.grads, memory.optimizer, memory.activations), rank
        assert _per_rank(d.comms(rank)).get(rank, {}) == _per_rank(comms).get(rank, {}), rank
        assert sorted(map(_shard_key, d.layout(rank=rank))) == sorted(map(_shard_key, shards)), rank
    assert_implicit_redistributes_predicted(d)  # the layout lint's cost prediction (tests/test_lint.py)


# ---------------------------------------------------------------- from a Session

@pytest.mark.session
def test_session_dry_run_matches_its_ranks_and_goes_beyond_them(session4):
    s = session4
    s.load_model("tiny-llama")
    plan = Plan(dp=2, tp=2, batch_size=8, seq_len=32)
    s.apply(plan)
    s.train(steps=1)
    live = sorted(s.memory(), key=lambda m: m.rank)
    same = s.dry_run()  # the applied plan, in this (client) process
    assert [(m.params, m.grads, m.optimizer, m.activations) for m in same.memory()] == \
        [(m.params, m.grads, m.optimizer, m.activations) for m in live]
    bigger = s.dry_run(Plan(dp=8, tp=2, pp=2, batch_size=32, seq_len=32))
    assert bigger.world == 32 > s.world_size and len(bigger.memory()) == 32
    with pytest.raises(PlanError, match=r"= 32 != ranks\(16\)"):
        s.dry_run(Plan(dp=8, tp=2, pp=2, batch_size=32), world=16)


@pytest.mark.multirank
def test_the_why_tree_names_sequence_parallels_gathers_live_and_dry(parity_steps):
    """tp2 with sequence parallel: the tree (records.comm_tree) puts each block's input gathers
    under the attention and the MLP that asked for them (the TP style's explicit S(1) -> R), and
    each norm's Partial gradient, summed once after backward, under that norm; nothing is
    implicit; the dry run's tree, every rank's from one simulated rank, is the live one."""
    from test_parallel_parity import ALL

    from interactive_parallel import dry_run
    from interactive_parallel.records import comm_tree

    live = [c for _, comms, _ in parity_steps["llama-tp2-sp", "fp32"].values() for c in comms]
    tree = comm_tree(live)
    nodes = {n.path: n for n in tree}
    for i in range(4):
        for block in ("self_attn", "mlp"):
            gather = nodes[f"model.layers.{i}.{block} / redistribute / all_gather S(1) -> R on tp"]
            assert (gather.count, gather.implicit, gather.ranks, gather.phase) == (2, 0, 2, "forward"), gather
        for norm in ("input_layernorm", "post_attention_layernorm"):
            reduced = nodes[f"model.layers.{i}.{norm} / redistribute / all_reduce P(sum) -> R on tp"]
            assert (reduced.count, reduced.implicit, reduced.ranks, reduced.phase) == (2, 0, 2, "backward"), reduced
    assert not any(n.implicit for n in tree)
    tops = [n for n in tree if n.depth == 0]
    assert sum(n.count for n in tops) == len(live) and sum(n.bytes for n in tops) == sum(c.bytes for c in live)
    preset, fields = ALL["llama-tp2-sp"]
    dry = dry_run(preset, Plan(**fields))
    assert len(dry.simulated) == 1 and dry.explain_comms() == tree
    assert dry.explain_comms(rank=1) == comm_tree(live, rank=1)


V2 = "0::/user.slice/job\n"
V1 = "4:memory:/\n2:cpu,cpuacct:/docker/ab\n0::/\n"


@pytest.mark.pure
@pytest.mark.parametrize("proc,files,cores", [
    (V2, {"cpu.max": "max 100000\n"}, None),
    (V2, {"user.slice/job/cpu.max": "150000 100000\n"}, 2),         # 1.5 cores: a second one is half usable
    (V2, {"cpu.max": "100000 100000\n"}, 1),                        # Binder's one core, on the root
    (V2, {"user.slice/job/cpu.max": "max 100000\n", "user.slice/cpu.max": "300000 100000\n",
          "cpu.max": "200000 100000\n"}, 2),                        # the tightest ancestor holds
    (V1, {"cpu/docker/ab/cpu.cfs_quota_us": "-1\n", "cpu/docker/ab/cpu.cfs_period_us": "100000\n"}, None),
    (V1, {"cpu/docker/ab/cpu.cfs_quota_us": "200000\n", "cpu/docker/ab/cpu.cfs_period_us": "100000\n"}, 2),
    (V1, {"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
    (V2, {}, None),
    ("", {"cpu.max": "100000 100000\n"}, None),                     # no cgroup file: nothing to read
])
def test_a_containers_cpu_quota_caps_the_cores_a_dry_run_forks_for(tmp_path, proc, files, cores):
    from interactive_parallel.runtime.rank.cores import cgroup_quota

    assert cgroup_quota(*_cgroups(tmp_path, proc, files)) == cores


def _cgroups(tmp_path, proc: str, files: dict[str, str]):
    """(a cgroup tree holding `files`, a /proc/self/cgroup saying `proc`) under tmp_path."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(proc)
    return root, tmp_path / "self-cgroup"


@pytest.mark.pure
@pytest.mark.parametrize("proc,files,limit", [
    (V2, {"user.slice/job/memory.max": "max\n", "user.slice/memory.max": "2000000000\n"}, 2 * 10**9),
    (V1, {"memory/memory.limit_in_bytes": "1500000000\n"}, 1_500_000_000),
    (V1, {"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1's "no limit"
    (V2, {}, None),
])
def test_the_memory_limit_is_the_tightest_of_the_cgroups_and_the_machine(tmp_path, proc, files, limit):
    from interactive_parallel.runtime.rank.cores import memory_limit

    machine = memory_limit(tmp_path / "none", tmp_path / "absent")  # the machine's memory alone
    assert machine is not None and memory_limit(*_cgroups(tmp_path, proc, files)) == min(limit or machine, machine)
