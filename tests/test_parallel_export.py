"""The exported torchrun script reproduces the session's run without ipyparallel.

Runs `torchrun --nproc_per_node 4` (the venv's torchrun) on the script text for
tiny-llama under dp2xtp2 (and a mixture of experts under dp2 x tp2 x ep2) and checks its first-step loss against the single-process run
(EXPORT_TOL absolute), which the parity tests tie to the same plan run in spawned ranks.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from interactive_parallel.plan import PRESETS, Plan
from interactive_parallel.plan.models import spec_from_config_dict
from interactive_parallel.runtime.client.export import script_text
import parity_workers as W

pytestmark = pytest.mark.multirank

EXPORT_TOL = 1e-5
PLAN = Plan(dp=2, tp=2)


def test_script_text_is_python_naming_the_plan():
    text = script_text(PRESETS["tiny-llama"], PLAN, 2)
    compile(text, "exported.py", "exec")
    assert "torchrun --nproc_per_node 4" in text and "ipyparallel" not in text.replace("(no ipyparallel)", "")


def test_every_new_plan_field_survives_the_script():
    """The script rebuilds the Plan from its text: the fields of the later layouts (uneven stages,
    schedules, ring attention, loss parallel, compile) come back equal, tuples included."""
    plan = Plan(pp=2, tp=2, stage_layers=(1, 3), pp_schedule="zbv", microbatches=4, cp_method="ring",
                loss_parallel=True, compile=False)
    text = script_text(PRESETS["tiny-llama"], plan, 2)
    literal = re.search(r"PLAN = Plan\(\*\*(\{.*?\})\)", text, re.S).group(1)
    assert Plan(**eval(literal)) == plan


def test_a_derived_familys_script_derives_again_and_reads_the_sessions_text(tmp_path):
    """The facts are not written out (the script's parallelize derives them from the config), and
    the text the session trained on is the script's too."""
    from interactive_parallel.records import DataSource
    from interactive_parallel.runtime.model.families import with_facts
    from test_any_model import BASE

    spec = with_facts(spec_from_config_dict(dict(BASE, model_type="qwen3"), name="tiny-qwen3"))
    text = script_text(spec, PLAN, 2, data=DataSource(path=str(tmp_path / "notes.txt")))
    compile(text, "exported.py", "exec")
    assert "'facts': None" in text and f"DataSource(path={str(tmp_path / 'notes.txt')!r}, format='text')" in text
    namespace: dict = {}
    exec(compile(text.split("def main()")[0], "exported.py", "exec"), namespace)  # the constants it runs with
    assert namespace["SPEC"].needs_facts and namespace["SPEC"].config == spec.config
    assert namespace["DATA"].path == str(tmp_path / "notes.txt")


def test_script_text_refuses_zero_steps():
    with pytest.raises(ValueError, match=r"steps\(0\)"):
        script_text(PRESETS["tiny-llama"], PLAN, 0)


def _spec(model: str):
    if model == "tiny-llama":
        return PRESETS[model]
    import moe_workers as M

    return M.spec_of(model)


@pytest.mark.parametrize("model, plan", [("tiny-llama", PLAN), ("mixtral", Plan(dp=2, tp=2, ep=2)),
                                         ("tiny-llama", Plan(pp=2, dp=2, pp_schedule="zbv")),
                                         ("tiny-llama", Plan(dp=2, tp=2, loss_parallel=True)),
                                         ("tiny-llama", Plan(dp=2, cp=2, cp_method="ring"))],
                         ids=["tiny-llama-dp2xtp2", "mixtral-dp2xtp2xep2", "tiny-llama-pp2xdp2-zbv",
                              "tiny-llama-dp2xtp2-loss-parallel", "tiny-llama-dp2xcp2-ring"])
def test_exported_script_reproduces_first_step_loss(tmp_path, model, plan):
    script = tmp_path / "run.py"
    spec = _spec(model)
    script.write_text(script_text(spec, plan, 2))
    torchrun = Path(sys.executable).with_name("torchrun")
    # PYTHONFAULTHANDLER: a rank that dies natively (SIGABRT, SIGSEGV) prints its Python stacks
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # --standalone: torchrun picks a free port itself. start_new_session + killpg on timeout:
    # killing torchrun alone would orphan its workers.
    proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc_per_node", "4", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun timed out:\n{stderr[-4000:]}")
    # the ranks' own lines come first on stderr, torchrun's summary of who failed last
    assert proc.returncode == 0, f"stdout:\n{stdout[-2000:]}\nranks' stderr:\n{stderr[:6000]}"
    losses = [float(m) for m in re.findall(r"step \d+ loss ([0-9.]+)", stdout)]
    assert len(losses) == 2, stdout
    # The single-process run: test_parallel_parity holds dp2xtp2 to it within 1e-5 per step.
    expected = W.reference(spec, plan.to_dict(), 1)["losses"][0]
    assert abs(losses[0] - expected) <= EXPORT_TOL, (losses, expected)
