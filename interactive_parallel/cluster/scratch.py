"""The session's scratch directory: where the ranks move state through files (re-plans, snapshots).

Owns one directory per session that every rank can read: by default a fresh one on the
host's tmpfs (records.state.scratch_base: /dev/shm unless $IP_SCRATCH_BASE says where), which outlives a killed
rank process on the same host, removed when the session stops; and a leash (the pool's
watcher, cluster/reaper.py, with a state file of its own) that removes it if this client
process dies first. A directory the user gives (`Session(state_dir=...)`, e.g. a shared
file system for ranks on several hosts) is used as it is and never removed; and whether
every rank reads it. Its parts are named once, in records.ScratchLayout. Knows nothing of
what the ranks write there (runtime/checkpoints/checkpoint.py) or of torch.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from typing import TYPE_CHECKING

from ..records import ScratchLayout
from ..records.state import scratch_base
from .errors import SessionError

if TYPE_CHECKING:
    from .rankset import RankSet


class Scratch:
    """A directory for the ranks' state files, created on first use."""

    def __init__(self, path: str | None = None):
        self.given = path is not None
        self._path = os.path.abspath(path) if path else None
        self._leash: subprocess.Popen | None = None
        self._leash_file: str | None = None
        self._watched: list[int] = []
        self._seen: dict[tuple, bool] = {}
        """(path, engine ids) -> whether every rank reads files there."""

    @property
    def path(self) -> str:
        if self._path is None:
            self._path = tempfile.mkdtemp(prefix="ip-state-", dir=scratch_base())
            self._start_leash()
        elif self.given:
            os.makedirs(self._path, exist_ok=True)
        return self._path

    def fresh(self) -> "Scratch":
        """Another scratch of the same kind: the same given path, or a new temporary one."""
        return Scratch(self._path if self.given else None)

    @property
    def created(self) -> bool:
        return self._path is not None

    def _start_leash(self) -> None:
        from . import reaper

        fd, self._leash_file = tempfile.mkstemp(prefix="ip-state-leash-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"groups": [], "paths": [self._path]}, f)
        self._leash = reaper.start(self._leash_file)

    def watch(self, pids: list[int]) -> None:
        """The processes on this host that write here (the ranks): if this client dies, the
        leash removes the directory only once they have ended (bounded), so a rank finishing
        a snapshot meanwhile cannot leave one behind."""
        if self._leash_file is None or sorted(pids) == self._watched:
            return
        from . import reaper

        reaper.write_state(self._leash_file, {"groups": [], "paths": [self._path], "wait": reaper.stamped(pids)})
        self._watched = sorted(pids)

    def pids(self) -> list[int]:
        return [self._leash.pid] if self._leash is not None else []

    async def shared(self, ranks: "RankSet") -> ScratchLayout | None:
        """The directory's layout when every rank can read it, else None. Ranks on one host
        share it; ranks on several hosts are asked (once per rank set; the caller has
        `require`d them) whether they see a file written there now (a shared file system, or
        hosts that are one machine)."""
        layout = ScratchLayout(self.path)
        if ranks.owned:  # its leash outwaits the writers
            self.watch(ranks.local_pids())
        hosts = {p.host for p in ranks.places}
        if len(hosts) <= 1:
            return layout
        key = (layout.root, tuple(p.engine_id for p in ranks.places))
        if key not in self._seen:
            with open(layout.shared_token, "w") as f:
                f.write("scratch")
            self._seen[key] = all(await ranks.call(os.path.isfile, (layout.shared_token,), what="scratch check"))
        return layout if self._seen[key] else None

    async def for_replan(self, ranks: "RankSet") -> ScratchLayout:
        """The layout a re-plan moves the state through, or SessionError when the ranks' hosts
        do not share the directory."""
        layout = await self.shared(ranks)
        if layout is None:
            hosts = sorted({p.host for p in ranks.places})
            raise SessionError(f"the ranks run on {len(hosts)} hosts ({', '.join(hosts)}) that do not share "
                               f"{self.path}: a re-plan moves the state through files every rank reads; "
                               "pass Session(state_dir=<a path on a file system they share>)")
        return layout

    def forget_snapshots(self) -> None:
        """Remove the snapshots (they belong to the model trained so far)."""
        if self.created:
            shutil.rmtree(ScratchLayout(self.path).snapshots, ignore_errors=True)

    def close(self) -> None:
        """Remove the directory (unless the user gave it) and stop its leash."""
        if self._path is not None and not self.given:
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None
        if self._leash_file is not None:
            try:
                os.remove(self._leash_file)  # the leash exits when its state file is gone
            except OSError:
                pass
            self._leash_file = None
        if self._leash is not None:
            self._leash.terminate()
            try:
                self._leash.wait(5)
            except subprocess.TimeoutExpired:
                self._leash.kill()
                self._leash.wait(5)
            self._leash = None
