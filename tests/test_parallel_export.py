"""The exported torchrun script reproduces the session's run without ipyparallel.

Runs `torchrun --nproc_per_node 4` (the venv's torchrun) on the script text for
tiny-llama under dp2xtp2 and checks its first-step loss against the same plan run
through runtime.api in spawned ranks (EXPORT_TOL absolute).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from interactive_parallel.plan import PRESETS, Plan
from interactive_parallel.runtime.export import script_text
from mp_harness import run_ranks
import parity_workers as W

pytestmark = pytest.mark.multirank

EXPORT_TOL = 1e-5
PLAN = Plan(dp=2, tp=2)


def test_script_text_is_python_naming_the_plan():
    text = script_text(PRESETS["tiny-llama"], PLAN, 2)
    compile(text, "exported.py", "exec")
    assert "torchrun --nproc_per_node 4" in text and "ipyparallel" not in text.replace("(no ipyparallel)", "")


def test_script_text_refuses_zero_steps():
    with pytest.raises(ValueError, match=r"steps\(0\)"):
        script_text(PRESETS["tiny-llama"], PLAN, 0)


def test_exported_script_reproduces_first_step_loss(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(script_text(PRESETS["tiny-llama"], PLAN, 2))
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([str(torchrun), "--nproc_per_node", "4", "--master_port", "0", str(script)],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [float(m) for m in re.findall(r"step \d+ loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 2, proc.stdout
    expected = run_ranks(W.parity_group, 4, [("x", "tiny-llama", PLAN.to_dict())], 1)[0]["x"]["losses"][0]
    assert abs(losses[0] - expected) <= EXPORT_TOL, (losses, expected)
