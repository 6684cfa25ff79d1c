"""The rank set under a Session: start or attach, rendezvous, calls with timeouts, recovery.

Owns the pool's lifetime (stop leaves nothing behind), the rank assignment (stable, with
per-host local ranks), the process group's rendezvous, remote calls that fail fast and
name the rank, and recovery after a failed collective or a dead rank (a fresh process
group, replacement engines, the weights carried over where a rank held them whole).
`doctor()`, `run()` and `view` live here. A base of Session: it reads the session's
spec and plan only to lay the model out again after a recovery; knows nothing of
training, telemetry or widgets, and never imports torch.
"""
from __future__ import annotations

import atexit
import os
import warnings
import weakref
from typing import Any, Callable

from ..records import RankInfo, RecordList
from ..runtime import api
from ._sync import run_sync
from .calls import RankCaller
from .errors import RankError, RankTimeout, SessionError
from .pool import Pool

_LIVE: "weakref.WeakSet[Ranks]" = weakref.WeakSet()


class Ranks:
    """Engines of an ipyparallel pool joined in one torch.distributed process group."""

    device: str
    threads: int | None
    timeout: float
    collective_timeout: float
    ranks_info: list[dict]
    spec: Any
    plan: Any

    def _init_ranks(self, pool: Pool, expected: int | None) -> None:
        self.ranks_info = []
        self._dirty = False
        self._paths: set[str] = set()
        self._importable = {"interactive_parallel", "torch", "transformers", "builtins", "math", "os"}
        self._caller: RankCaller | None = None
        self._view = None
        self._pool: Pool | None = pool
        try:
            self._connect(expected=expected)
        except BaseException:
            self.stop()
            raise
        _LIVE.add(self)

    # ---- lifecycle -------------------------------------------------------------------------
    def _connect(self, expected: int | None) -> None:
        pool = self._pool
        ids = pool.engine_ids
        if expected is not None and len(ids) != expected:
            raise SessionError(f"pool has {len(ids)} engines, expected {expected}")
        probe = RankCaller(pool.client, ids)
        facts = probe.wait(probe.submit(api.identify), self.timeout, "identify")
        # Stable order: hosts in order of their lowest engine id, engine ids within a host,
        # so a host's ranks are contiguous (TP, the innermost mesh axis, stays on one host).
        hosts = list(dict.fromkeys(f["host"] for f in facts))
        order = sorted(range(len(ids)), key=lambda i: (hosts.index(facts[i]["host"]), ids[i]))
        ids = [ids[i] for i in order]
        facts = [facts[i] for i in order]
        if self.device == "cuda":
            short = [f"{f['host']} has {f['cuda']} GPU(s)" for f in facts if f["cuda"] == 0]
            if short:
                raise SessionError("device 'cuda' asked for, but " + "; ".join(sorted(set(short))))
        local = {}
        self.ranks_info = []
        for rank, f in enumerate(facts):
            local_rank = local.setdefault(f["host"], 0)
            local[f["host"]] += 1
            self.ranks_info.append(dict(f, rank=rank, engine_id=ids[rank], local_rank=local_rank))
        per_host = {h: n for h, n in local.items()}
        if self.device == "cuda":
            over = [f"{h}: {n} ranks > {facts[0]['cuda']} GPUs" for h, n in per_host.items()
                    if n > min(f["cuda"] for f in facts if f["host"] == h)]
            if over:
                raise SessionError("one GPU per local rank needed; " + "; ".join(over))
        self._caller = RankCaller(pool.client, ids, [f["host"] for f in facts])
        self._view = pool.client[ids]
        self._view.block = True  # %px cells show each rank's output when they finish
        world = len(ids)
        self._wait(self._caller.submit(api.setup, per_rank=lambda r: (
            (r, world, self.ranks_info[r]["local_rank"], per_host[self.ranks_info[r]["host"]], self.threads), {})),
            "setup")
        self.view.execute(
            "import torch, torch.distributed as dist\n"
            "from interactive_parallel.runtime import state as _ip_state\n"
            "rank, world_size, local_rank = _ip_state.get().rank, _ip_state.get().world_size, "
            "_ip_state.get().local_rank\n", block=True)
        self._init_process_group()
        if _in_ipython():
            self.view.activate()  # %px / %%px in this IPython kernel now reach the ranks

    def _init_process_group(self) -> None:
        loopback = len({r["host"] for r in self.ranks_info}) == 1
        addr, port = self._wait(self._caller.submit(api.master_endpoint, (loopback,), ranks=[0]), "rendezvous")[0]
        self._wait(self._caller.submit(api.init_process_group, (addr, port, self.device, self.collective_timeout)),
                   "init_process_group", timeout=self.collective_timeout + 10)

    @property
    def world_size(self) -> int:
        return len(self._caller.engine_ids) if self._caller else 0

    @property
    def view(self):
        """The ipyparallel DirectView of the ranks, in rank order (for %px and your own code)."""
        if self._pool is None or self._pool.client is None:
            raise SessionError("the session is stopped")
        return self._view

    def stop(self) -> None:
        """Release the ranks: tear down the process group and, for a pool we started, stop
        every engine and the controller and delete their files."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        try:
            if self._caller is not None and not pool.owned:
                self._caller.wait(self._caller.submit(api.teardown), 10, "teardown")
        except Exception:  # noqa: BLE001 - stopping must not fail half-way
            pass
        finally:
            self._caller = None
            pool.stop()
            _LIVE.discard(self)

    close = stop

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- calling ranks ---------------------------------------------------------------------
    def _require(self) -> RankCaller:
        if self._pool is None or self._caller is None:
            raise SessionError("the session is stopped")
        if self._caller.pending:
            stuck = self._caller.drain(self.collective_timeout + 10)
            if stuck:
                raise SessionError(f"rank(s) {stuck} are still busy with an earlier call")
        dead = self.dead_ranks()
        if dead:
            if not self._pool.owned:
                raise SessionError(f"rank(s) {dead} died; restart their engines in the cluster, then "
                                   "call restart_ranks()")
            warnings.warn(f"rank(s) {dead} died; starting replacements")
            self._recover(replace=len(dead))
        elif self._dirty:
            self._recover()
        return self._caller

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine is gone (killed, out of memory, crashed)."""
        alive = set(self._pool.client.ids) if self._pool is not None and self._pool.client else set()
        return [r for r, eid in enumerate(self._caller.engine_ids) if eid not in alive] if self._caller else []

    def restart_ranks(self) -> None:
        """Replace dead ranks (local pool) or pick up the engines now in the cluster (attached),
        form a new process group and lay the model out again, weights carried where a rank
        held them whole."""
        self._recover(replace=len(self.dead_ranks()) if self._pool.owned else 0)

    def _recover(self, replace: int = 0) -> None:
        """After a failure that may have left collectives half-done, or a dead rank: a fresh
        process group (and replacement engines), then the model laid out again."""
        self._dirty = False
        dead = set(self.dead_ranks())
        survivors = [r for r in range(self.world_size) if r not in dead]
        kept = self._caller.wait(self._caller.submit(api.snapshot_local, ranks=survivors), self.timeout, "recover")
        if replace or dead:
            self._caller.pending = []
            if replace:
                self._pool.add_engines(replace, timeout=self.timeout)
            self._connect(expected=None)
        else:
            self._init_process_group()
        if self.spec is not None and self.plan is not None:
            shared = all(self._wait(self._caller.submit(api.share_carry, (0,)), "recover")) and all(kept)
            if not shared:
                warnings.warn("the failure left no whole copy of the weights; the model restarts from its seed")
            self._wait(self._caller.submit(api.load_model, (self.spec.__dict__,)), "load_model")
            self._wait(self._caller.submit(api.apply_plan, (self.plan.to_dict(),)), "apply")

    def _wait(self, submitted, what: str, timeout: float | None = None) -> list:
        try:
            return self._caller.wait(submitted, timeout or self.timeout, what)
        except (RankError, RankTimeout):
            self._dirty = bool(self._caller.pending) or self._dirty
            raise

    async def _wait_async(self, submitted, what: str, timeout: float | None = None) -> list:
        try:
            return await self._caller.wait_async(submitted, timeout or self.timeout, what)
        except (RankError, RankTimeout):
            self._dirty = bool(self._caller.pending) or self._dirty
            raise

    async def run_async(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        caller = self._require()
        await self._make_importable(fn)
        return await self._wait_async(caller.submit(fn, args, kwargs), getattr(fn, "__name__", "run"), timeout)

    async def _make_importable(self, fn: Callable) -> None:
        """ipyparallel ships a module-level function by reference: its module must import on
        the ranks. For a function from a local script or test file, put its folder on the
        ranks' sys.path (once), as a notebook's own functions already travel by value."""
        import sys

        module = sys.modules.get(getattr(fn, "__module__", "") or "")
        path = getattr(module, "__file__", None)
        if module is None or module.__name__ == "__main__" or not path:
            return
        folder = os.path.dirname(os.path.abspath(path))
        if module.__name__.split(".")[0] in self._importable or folder in self._paths:
            return
        await self._wait_async(self._caller.submit(_add_sys_path, (folder,)), "sys.path")
        self._paths.add(folder)

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """fn(*args, **kwargs) on every rank (process group ready); the results in rank order."""
        return run_sync(self.run_async(fn, *args, timeout=timeout, **kwargs))

    # ---- actions ---------------------------------------------------------------------------
    async def doctor_async(self) -> RecordList:
        caller = self._require()
        rows = await self._wait_async(caller.submit(api.doctor, per_rank=lambda r: ((caller.engine_ids[r],), {})),
                                      "doctor", timeout=self.collective_timeout + 10)
        cols = ("rank", "host", "pid", "local_rank", "device", "backend", "threads", "torch", "transformers",
                "barrier_ok", "all_reduce_ok", "bandwidth_gbps", "error")
        return RecordList([RankInfo.from_dict(r) for r in rows], columns=cols)

    def doctor(self) -> RecordList:
        """Per rank: host, pid, device, versions, backend, threads; a barrier, a checked
        all_reduce and a timed one (bandwidth). Printable as a table."""
        return run_sync(self.doctor_async())

    def reset_process_group(self) -> None:
        """Tear the process group down and rendezvous again (engines and weights kept where
        every rank holds them whole)."""
        self._require()
        self._dirty = True
        self._require()


def _add_sys_path(folder: str) -> None:
    import sys

    if folder not in sys.path:
        sys.path.append(folder)


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


@atexit.register
def _stop_all() -> None:
    for s in list(_LIVE):
        s.stop()
