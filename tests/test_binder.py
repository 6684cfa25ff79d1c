"""The Binder setup works from scratch: a fresh virtual environment from binder/requirements.txt,
binder/postBuild run in it, and the tour executed headless by a kernel of that environment with
every check tests/test_notebooks.py makes of a notebook (the tour's only run in the suite), with
the kernel and every process it starts (controller, zygote, engines, watcher) under Binder's 2 GB
for the whole tree: a memory cgroup made for the run where /sys/fs/cgroup is writable (v2 memory.max
or v1 memory.limit_in_bytes; the kernel spec's argv enters it before the kernel executes, and every
descendant inherits it), else per-process `prlimit --data` limits (each process alone, a weaker
check); tests/memory_limit.py, and the failure names which. Outgrowing it OOM-kills a process of
the tour, and the test fails saying so.

Uses this machine's pip configuration as it is. binder/requirements.txt names PyTorch's CPU index
with --extra-index-url; where that index is unreachable pip only warns and takes torch from the
other configured sources (measured: no failure), but with its default 5 retries per page and
backoff it spends half an hour on the warnings. `--retries 0 --timeout 10` keeps a failed index
to one quick attempt and changes nothing where the index answers. `--no-compile` leaves the
bytecode to the first import (byte-compiling every installed file, most never imported, took
half of the install). Slow (a torch install and the tour).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager

from memory_limit import MemoryLimit
from test_notebooks import NOTEBOOKS, TOUR, run_notebook

pytestmark = [pytest.mark.slow, pytest.mark.notebook]
ROOT = Path(__file__).resolve().parent.parent
KERNEL = "binder-venv"
BINDER_BYTES = 2 * 10**9
"""Binder's memory for the whole container (mybinder.org: 2 GB), the tour's whole process tree held to it."""


def run(cmd: list[str], env: dict | None = None, timeout: float = 1200) -> None:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_binder_environment_runs_the_tour(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    py = venv / "bin" / "python"
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(py), "-m", "pip", "install", "--retries", "0", "--timeout", "10", "--no-compile",
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
    spec = KernelSpecManager().get_kernel_spec(KERNEL)
    assert spec.argv[0] == str(py)  # the fresh environment's python
    with MemoryLimit(BINDER_BYTES) as limit:
        spec_file = Path(spec.resource_dir) / "kernel.json"
        spec_file.write_text(json.dumps(dict(spec.to_dict(), argv=limit.wrap(spec.argv))))
        try:
            run_notebook(next(p for p in NOTEBOOKS if p.stem == TOUR), tmp_path, kernel=KERNEL)
        except Exception as e:  # noqa: BLE001 - an OOM kill shows up as a dead kernel or a failed cell
            if limit.oom_killed() or "MemoryError" in str(e):  # prlimit: an allocation fails instead
                pytest.fail(f"the tour outgrew Binder's budget: {BINDER_BYTES / 1e9:.1f} GB for the kernel's whole "
                            f"process tree ({limit.kind}); the OOM killer ended {limit.oom_killed()} process(es): "
                            f"{type(e).__name__}: {e}"[:2000], pytrace=False)
            raise
        assert not limit.oom_killed(), f"a process of the tour was OOM-killed under {limit.kind} = {BINDER_BYTES} bytes"
        peak = limit.peak_bytes()
        print(f"tour under {limit.kind} = {BINDER_BYTES / 1e9:.1f} GB: peak charge "
              f"{'unknown' if peak is None else f'{peak / 1e9:.2f} GB (page cache included)'}")
