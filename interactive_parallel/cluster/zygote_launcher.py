"""ipyparallel's engine-set launcher for engines forked from one zygote (cluster/zygote.py).

`ipp.Cluster(n=4, engines=ZYGOTE_ENGINES)`, or `ipcluster start -n 4 --engines=<ZYGOTE_ENGINES>`,
starts the n engines of a local cluster the way a local pool does: one process imports torch and
transformers and forks them, so they share its pages instead of importing torch once each (an
engine started by ipyparallel's own local launcher holds about 330 MiB of its own, measured with
bench/bench_notebook_memory.py; a forked one about 100 MiB). The cluster sees one launcher process;
stopping it signals the zygote, which forwards the signal to the engines it forked. No nanny
process (the controller's heartbeat already notices a dead engine). Knows nothing of ranks.
"""
from __future__ import annotations

import os
import sys

from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher

ZYGOTE_ENGINES = f"{__name__}.ZygoteEngineSetLauncher"
"""What to pass as `engines=` to ipyparallel.Cluster (an import string, as ipyparallel takes it)."""


class _ZygoteLauncher(LocalEngineLauncher):
    """The one process: `python -m interactive_parallel.cluster.zygote N PROFILE_DIR ENGINE_FILE`."""

    def find_args(self):
        return list(self.engine_cmd)


class ZygoteEngineSetLauncher(LocalEngineSetLauncher):
    launcher_class = _ZygoteLauncher

    def start(self, n):
        """Start one zygote that forks n engines once the controller's connection file is there."""
        self.n = n
        engine_file = os.path.join(self.profile_dir, "security", f"ipcontroller-{self.cluster_id}-engine.json")
        el = self.launchers["0"] = self.launcher_class(
            work_dir=self.work_dir, parent=self, log=self.log, profile_dir=self.profile_dir,
            cluster_id=self.cluster_id, environment=self.environment, identifier="0",
            output_file=os.path.join(self.profile_dir, "log", f"zygote-{self.cluster_id}-{self.engine_set_id}.log"))
        el.engine_cmd = [sys.executable, "-m", "interactive_parallel.cluster.zygote", str(n), self.profile_dir,
                         engine_file]
        el.on_stop(self._notice_engine_stopped)
        started = [el.start()]
        self.notify_start(started)
        return started
