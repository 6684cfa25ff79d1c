"""The client's refusals (cluster/checks.py, cluster/checkpoints.py, cluster/fetch.py) on inputs alone: pure, no
ranks. Each names every problem with its numbers."""
import asyncio
import json
import os
import types

import pytest

from interactive_parallel.cluster import checkpoints, checks
from interactive_parallel.cluster import fetch as fetching
from interactive_parallel.cluster.errors import SessionError
from interactive_parallel.plan import Plan, PlanError, resolve_model
from interactive_parallel.records import FaultSpec, Request, ShardRecord

pytestmark = pytest.mark.pure
SPEC = resolve_model("tiny-llama")


def test_a_plan_for_another_device_and_size_names_both():
    with pytest.raises(PlanError) as e:
        checks.check_plan(Plan(dp=2, tp=3, device="cuda"), "cpu", 4, SPEC)
    text = str(e.value)
    assert "plan device 'cuda' != session device 'cpu'" in text and "ranks(4)" in text
    assert checks.check_plan(Plan(dp=4), "cpu", 4, SPEC) == Plan(dp=4)


def test_debug_mode_refuses_ddp_only():
    with pytest.raises(SessionError, match="DDP crashes"):
        checks.check_debug_plan(Plan(dp=4), debugging=True)
    checks.check_debug_plan(Plan(dp=4), debugging=False)
    checks.check_debug_plan(Plan(fsdp=4), debugging=True)
    checks.check_debug_plan(Plan(dp=2, tp=2), debugging=True)


def test_counts_name_every_bad_one():
    with pytest.raises(PlanError) as e:
        checks.check_counts(steps=-1, snapshot_every=True)
    assert e.value.problems == ["steps(-1) must be a whole number >= 0",
                                "snapshot_every(True) must be a whole number >= 0"]
    checks.check_counts(steps=0, snapshot_every=20)


def test_prompts_too_long_for_the_model_are_refused_with_the_numbers():
    with pytest.raises(ValueError) as e:
        checks.check_prompts(["x" * SPEC.max_positions], 4, 0.0, -1, SPEC)
    text = str(e.value)
    assert f"longest prompt({SPEC.max_positions}) + max_new_tokens(4)" in text
    assert "temperature(0.0) must be > 0" in text and "top_k(-1) must be >= 0" in text
    with pytest.raises(ValueError, match="no prompts given"):
        checks.check_prompts([], 4, 1.0, 0, SPEC)


def test_requests_come_from_strings_dicts_or_requests():
    reqs = checks.as_requests(["ab", {"id": "q", "prompt": "cd"}, Request(id="r", prompt="ef")])
    assert checks.check_requests(reqs, SPEC, 8, None) == reqs
    assert [r.id for r in reqs] == ["0", "q", "r"] and all(isinstance(r, Request) for r in reqs)
    with pytest.raises(TypeError, match="request 0 is a int"):
        checks.as_requests([3])


def test_prompt_lengths_are_the_tokenizers_when_it_counts_them():
    """A model's own tokenizer may give a prompt more tokens than characters (byte-level BPE on
    non-ASCII text): the checks take its counts, from rank 0, over one per character."""
    long = SPEC.max_positions
    checks.check_prompts(["ab"], 4, 1.0, 0, SPEC)
    with pytest.raises(ValueError, match=rf"longest prompt\({long}\) \+ max_new_tokens\(4\) > "):
        checks.check_prompts(["ab"], 4, 1.0, 0, SPEC, lengths=[long])
    reqs = checks.as_requests(["ab"])
    with pytest.raises(ValueError, match=rf"prompt\({long}\) \+ max_new_tokens"):
        checks.check_requests(reqs, SPEC, 8, None, lengths=[long])
    with pytest.raises(ValueError, match=r"prompt\(9\) \+ max_new_tokens\(16\) = 25 > kv_tokens\(16\)"):
        checks.check_requests(reqs, SPEC, 8, 16, lengths=[9])
    assert checks.prompt_strings(["a", "b"]) and not checks.prompt_strings(["a", 3]) and not checks.prompt_strings([])


def test_a_fault_names_every_bad_field():
    with pytest.raises(ValueError) as e:
        checks.check_fault(FaultSpec(rank=4, fault="melt", where="nowhere", at_step=-1, seconds=-2), 4,
                           ("kill", "raise"), ("step", "collective"))
    text = str(e.value)
    for part in ("rank(4) is not one of 0..3", "fault 'melt'", "where 'nowhere'", "at_step(-1)", "seconds(-2)"):
        assert part in text


@pytest.mark.parametrize("args, message", [((0, "cpu", None, 20), "ranks(0)"),
                                           ((2, "tpu", None, 20), "device 'tpu'"),
                                           ((2, "cpu", " ", 20), "interface ' '"),
                                           ((2, "cpu", None, -1), "snapshot_every(-1)"),
                                           ((2, "cpu", None, 20, None, -5), "flight_recorder(-5)")])
def test_session_arguments_are_refused_before_any_process(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checks.check_session_args(*args)


def test_a_save_replaces_only_a_checkpoint(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        checkpoints.refuse_replacing(str(tmp_path / "notes"))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / checkpoints.MANIFEST).write_text("{}")
    checkpoints.refuse_replacing(str(tmp_path / "ckpt"))
    checkpoints.refuse_replacing(str(tmp_path / "absent"))


def test_a_load_of_another_model_names_its_parameters(tmp_path):
    other = resolve_model("tiny-gpt2")
    path = tmp_path / "ckpt"
    path.mkdir()
    import dataclasses

    (path / checkpoints.MANIFEST).write_text(json.dumps({"model": dataclasses.asdict(other)}))
    with pytest.raises(checkpoints.CheckpointError) as e:
        checkpoints.check_loadable(str(path), SPEC)
    assert "is of model 'tiny-gpt2'" in str(e.value) and e.value.problems
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        checkpoints.check_loadable(str(tmp_path), SPEC)
    assert checkpoints.check_loadable(str(path), other) == os.path.abspath(path)


def test_a_site_launcher_is_refused_before_anything_starts():
    """Session.start: an unknown launcher, or hosts offering fewer engines than ranks, are
    refused naming the numbers, before any controller or temporary directory exists."""
    import tempfile
    from pathlib import Path

    from interactive_parallel import Session
    from interactive_parallel.cluster.launchers import slurm_template

    made = lambda: {p for name in ("pbs", "ssh") for p in Path(tempfile.gettempdir()).glob(f"ip-{name}-*")}  # noqa: E731
    before = made()
    with pytest.raises(ValueError, match="launcher 'pbs' is not one of slurm, mpi, ssh"):
        Session.start("pbs", 2, controller_ip="127.0.0.1")
    with pytest.raises(ValueError, match=r"hosts \{'node1': 1\} offer 1 engines, fewer than ranks\(2\)"):
        Session.start("ssh", 2, hosts={"node1": 1}, controller_ip="127.0.0.1")
    with pytest.raises(ValueError, match=r"ranks\(0\)"):
        Session.start("slurm", 0, controller_ip="127.0.0.1")
    assert made() == before
    # what sbatch is asked for: the tasks, the nodes and the tasks on each, the output beside the profile
    lines = slurm_template(2, 4).splitlines()
    assert {"#SBATCH --ntasks={n}", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
            "#SBATCH --output={output_file}"} <= set(lines) and lines[-1] == "srun {program_and_args}"


# ---- fetch: any rank's tensor (cluster/fetch.py) ---------------------------------------------------
def _shard(param, rank, index, stage=None):
    shape = [8, 4]
    return ShardRecord(param=param, rank=rank, global_shape=shape, local_shape=[b - a for a, b in index],
                       placements=["Shard(dim=0)"], mesh_axes=["tp"], coords={"tp": rank % 2}, index=index, stage=stage)


# pp2 x tp2: stage 0 on ranks 0-1, stage 1 on ranks 2-3, each weight split in rows over tp
FETCH_LAYOUT = [_shard(f"model.layers.{layer}.mlp.up_proj.weight", rank, [[4 * (rank % 2), 4 * (rank % 2) + 4], [0, 4]],
                       stage=layer) for layer in (0, 1) for rank in (2 * layer, 2 * layer + 1)]


class _Untouchable:
    """A rank set whose every call fails the test: the refusals come before any rank is asked."""

    world_size = 4

    async def require(self):
        pytest.fail("rank touched")

    async def call(self, *a, **k):
        pytest.fail("rank touched")


def _fetch(name, rank=0, *, full=False, what="param", limit_bytes=fetching.FULL_LIMIT_BYTES, model=None):
    async def layout():
        return FETCH_LAYOUT

    model = model or types.SimpleNamespace(require_layout=lambda: None, quantization=None, layout=layout, data=None)
    return asyncio.run(fetching.fetch(model, _Untouchable(), name, rank, full, what, limit_bytes))


def test_a_fetch_is_refused_before_any_rank_with_the_nearest_names_the_world_and_the_kinds():
    with pytest.raises(fetching.FetchError, match=r"nearest: model\.layers\.0\.mlp\.up_proj\.weight"):
        _fetch("model.layers.0.mlp.up_prj.weight")
    with pytest.raises(fetching.FetchError, match=r"rank 4 is outside this session of 4 ranks \(0 \.\. 3\)"):
        _fetch("model.layers.0.mlp.up_proj.weight", rank=4)
    with pytest.raises(fetching.FetchError, match="param, grad, exp_avg, exp_avg_sq, step"):
        _fetch("model.layers.0.mlp.up_proj.weight", what="momentum")
    with pytest.raises(fetching.FetchError, match=r"rank 0 does not hold .*layers\.1.*: it lives in pipeline stage 1, "
                                                  r"held by ranks \[2, 3\]"):
        _fetch("model.layers.1.mlp.up_proj.weight", rank=0)
    assert fetching.TENSOR_KINDS == ("param", "grad", "exp_avg", "exp_avg_sq", "step")


def test_a_whole_tensor_over_the_limit_is_refused_with_its_size_and_the_limit():
    with pytest.raises(fetching.FetchError, match=r"is 128 B \(128 bytes\), shape \(8, 4\) fp32, over the limit "
                                                  r"of 100 B \(100 bytes\) for full=True"):
        _fetch("model.layers.1.mlp.up_proj.weight", full=True, limit_bytes=100)
    # the default limit is stated, and a whole tensor needs one block per distinct range: ranks 2 and 3
    assert fetching.FULL_LIMIT_BYTES == 256 * 2**20
    assert [r.rank for r in fetching.holders_of(FETCH_LAYOUT, "model.layers.1.mlp.up_proj.weight", 0, True)] == [2, 3]


def test_a_fetch_without_a_layout_says_so():
    from interactive_parallel.cluster.model_ops import ModelOps
    from interactive_parallel.cluster.recovery import ModelState, Recovery

    model = ModelOps(_Untouchable(), None, Recovery(ModelState(), None, None))
    with pytest.raises(SessionError, match=r"no model laid out: call load_model\(...\) and apply\(Plan\(...\)\) first"):
        _fetch("model.layers.0.mlp.up_proj.weight", model=model)
