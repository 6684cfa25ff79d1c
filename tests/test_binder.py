"""The Binder setup works from scratch: a fresh virtual environment from binder/requirements.txt,
binder/postBuild run in it, and the tour executed headless by a kernel of that environment with
every check tests/test_notebooks.py makes of a notebook (the tour's only run in the suite).

Uses this machine's pip configuration as it is. binder/requirements.txt names PyTorch's CPU index
with --extra-index-url; where that index is unreachable pip only warns and takes torch from the
other configured sources (measured: no failure), but with its default 5 retries per page and
backoff it spends half an hour on the warnings. `--retries 0 --timeout 10` keeps a failed index
to one quick attempt and changes nothing where the index answers. Slow (a torch install, ~2 min).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager

from test_notebooks import NOTEBOOKS, TOUR, run_notebook

pytestmark = [pytest.mark.slow, pytest.mark.notebook]
ROOT = Path(__file__).resolve().parent.parent
KERNEL = "binder-venv"


def run(cmd: list[str], env: dict | None = None, timeout: float = 1200) -> None:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_binder_environment_runs_the_tour(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    py = venv / "bin" / "python"
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(py), "-m", "pip", "install", "--retries", "0", "--timeout", "10",
         "-r", str(ROOT / "binder" / "requirements.txt"), "ipykernel", "nbclient"])
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    env.pop("PYTHONPATH", None)
    run(["bash", str(ROOT / "binder" / "postBuild")], env=env)

    config = venv / "etc" / "jupyter" / "jupyter_server_config.d" / "interactive_parallel.json"
    assert json.loads(config.read_text())["ServerApp"]["default_url"] == "/lab/tree/notebooks/00_tour.ipynb"
    run([str(py), "-c", "import interactive_parallel, torch; assert torch.__version__.endswith('+cpu') "
         "or not torch.cuda.is_available()"], env=env)

    run([str(py), "-m", "ipykernel", "install", "--prefix", str(venv), "--name", KERNEL], env=env)
    monkeypatch.setenv("JUPYTER_PATH", str(venv / "share" / "jupyter"))
    monkeypatch.setenv("PATH", env["PATH"])
    assert KernelSpecManager().get_kernel_spec(KERNEL).argv[0] == str(py)  # the fresh environment's python
    run_notebook(next(p for p in NOTEBOOKS if p.stem == TOUR), tmp_path, kernel=KERNEL)
