"""The rank set: engines of an ipyparallel pool joined in one torch.distributed process group.

Owns the pool's lifetime (stop leaves nothing behind), the rank assignment (stable, with
per-host local ranks: `places`), every remote call with its timeout (one long call at a time
may stream records back and be stopped), what is gathered when a call fails (dead processes,
ranks left running, faults that fired) for cluster/diagnose.py to name, and recovery after a
failed collective, a dead rank or a dead controller of our own pool: a fresh process group,
replacement engines or a whole new pool, and then the `Relayout` collaborator it was built
with lays the model out again. So any call made through `require()` may recover first. The
clocks (cluster/clocks.py) and the rendezvous (cluster/rendezvous.py) are measured and formed
through it. It knows nothing of models, plans or training. `doctor()` and `run()` live here;
never imports torch.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from ..records import ClockRecord, FaultSpec, RankPlace, RecordList
from ..runtime import api
from . import clocks, diagnose, engine_side, rendezvous
from .calls import RankCaller, Submitted
from .checks import check_fault
from .diagnose import STUCK_MARGIN_S
from .errors import RankError, RankTimeout, SessionError
from .evidence import announcement_due, gather_evidence
from .pool import LocalPool, Pool, process_gone

DOCTOR_COLUMNS = ("rank", "host", "pid", "local_rank", "gpu", "device", "backend", "address", "threads", "torch",
                  "transformers", "barrier_ok", "all_reduce_ok", "bandwidth_gbps", "error")


class Relayout(Protocol):
    """What a rank set calls around a re-formed process group (cluster/recovery.py implements it)."""

    async def before_reform(self, ranks: "RankSet", survivors: list[int]) -> None:
        """On the ranks that are alive and idle (`survivors`), before the group is re-formed:
        keep what should outlive it."""

    async def after_reform(self, ranks: "RankSet", replaced: bool) -> None:
        """On the new group: lay the model out again. `replaced`: some ranks are new processes
        (or ranks were renumbered), so what the survivors kept does not cover them."""


@dataclass
class RankSet:
    """Engines in rank order, their process group, and calls to them."""

    pool: Pool | None
    device: str = "cpu"
    threads: int | None = None
    timeout: float = 120.0
    """Seconds a remote call (or a stretch of a streaming call without progress) may take."""
    collective_timeout: float = 60.0
    """Seconds any collective may wait on the ranks before it fails."""
    interface: str | None = None
    """Network interface of the process group on every rank (None: loopback on one host, else
    the interface rank 0 reaches the controller through, and on each rank the one toward rank 0)."""
    recorder_entries: int | None = None
    """Collectives torch's flight recorder keeps per rank over every group (None: its default)."""
    relayout: Relayout | None = None
    """Lays the model out again around every re-formed group (given when the Session is built)."""
    places: list[RankPlace] = field(default_factory=list)
    """Per rank: engine, host, pid, cores, GPUs, local rank; interface and address once the group
    is formed (from the ranks themselves)."""
    clocks: list[ClockRecord] = field(default_factory=list)
    """Per rank: its clock's offset from this client's, measured at connect."""
    caller: RankCaller | None = None
    view: Any = None
    """The ipyparallel DirectView of the ranks, in rank order (%px reaches them through it)."""
    running: Submitted | None = None
    """The streaming call in flight (interrupt() aborts it)."""
    faults: list[FaultSpec] = field(default_factory=list)
    """Faults armed for the next long call (so its error can say which one it was)."""
    fired: list[FaultSpec] = field(default_factory=list)
    """Faults that fired during the latest long call (each with its time on this client's clock)."""
    dirty: bool = False
    """A call failed with peers possibly left in a collective: re-form the group before the next."""
    patience: float = 0.0
    """After the latest failure: seconds (from caller.failed_at) its stragglers may still take."""
    _gone_engines: set[int] = field(default_factory=set)
    """Engine ids whose process is gone, though the controller may not have noticed yet."""
    _paths: set[str] = field(default_factory=set)  # folders put on every rank's sys.path (and a later one's)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def connect(self, expected: int | None = None) -> None:
        """Assign ranks, set each one up and form the process group (on a new or re-formed pool)."""
        pool = self.pool
        ids = [e for e in pool.engine_ids if e not in self._gone_engines][:pool.wanted]
        if expected is not None and len(ids) != expected:
            raise SessionError(f"pool has {len(ids)} engines, expected {expected}")
        probe = RankCaller(pool.client, ids)
        facts = await probe.wait(probe.submit(api.identify), self.timeout, "identify")
        pinned = {p.engine_id: p.gpu for p in self.places if p.gpu >= 0}
        self.places = rendezvous.assign(ids, facts, self.device, pinned)
        ids = [p.engine_id for p in self.places]
        hosts = [p.host for p in self.places]
        self.caller = RankCaller(pool.client, ids, hosts, dead=self.dead_ranks)
        self.view = pool.client[ids]
        self.view.block = True  # %px cells show each rank's output when they finish
        world = len(ids)
        per_host = {h: hosts.count(h) for h in hosts}
        await self.call(api.setup, per_rank=lambda r: (
            (r, world, self.places[r].local_rank, per_host[hosts[r]], self.threads, self.places[r].gpu), {}),
            what="setup")
        await self.call(engine_side.install, what="setup")
        await self.call(engine_side.define_px_names, what="setup")
        await self.call(engine_side.add_sys_path, sorted(self._paths), what="sys.path")  # as its peers were given
        await self.measure_clocks()
        await self.form_group()
        if _in_ipython():
            self.view.activate()  # %px / %%px in this IPython kernel now reach the ranks

    async def measure_clocks(self) -> list[ClockRecord]:
        """Each rank's clock offset from this client's (cluster/clocks.py)."""
        self.clocks = await clocks.measure(self.call, [p.host for p in self.places])
        return self.clocks

    def clock_offsets(self) -> dict[int, float]:
        """Rank -> seconds its clock is ahead of this client's."""
        return {c.rank: c.offset_s for c in self.clocks}

    async def form_group(self) -> None:
        """Rendezvous (cluster/rendezvous.py); each place learns its interface and address."""
        joined = await rendezvous.form_group(self.call, self.places, device=self.device, interface=self.interface,
                                             collective_timeout=self.collective_timeout, recorder_entries=self.recorder_entries)
        self.places = [dataclasses.replace(p, interface=j.interface, address=j.address)
                       for p, j in zip(self.places, joined)]

    @property
    def world_size(self) -> int:
        return len(self.caller.engine_ids) if self.caller else 0

    @property
    def alive(self) -> bool:
        return self.pool is not None and self.caller is not None

    @property
    def owned(self) -> bool:
        """The pool is ours (started by this session on this machine)."""
        return self.pool is not None and self.pool.owned

    def stop(self) -> None:
        """Release the ranks: tear down the process group and, for a pool we started, stop every
        engine and the controller and delete their files."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        try:
            if self.caller is not None and not pool.owned:
                from .twins import run_sync

                run_sync(self.caller.wait(self.caller.submit(api.teardown), 10, "teardown"))
        except Exception:  # noqa: BLE001 - stopping must not fail half-way
            pass
        finally:
            self.caller = self.view = None
            pool.stop()

    # ---- calling ranks ---------------------------------------------------------------------------
    async def require(self) -> RankCaller:
        """The caller, after bringing the ranks back into shape if the last call left them out of
        it: stragglers drained or replaced, dead ranks replaced, a dead controller's pool started
        anew, a broken group re-formed; then `relayout` lays the model out again (recover)."""
        if self.pool is None or self.caller is None:
            raise SessionError("the session is stopped")
        if self.running is not None:
            raise SessionError("the ranks are busy with a running call (train/generate): interrupt() it "
                               "or wait for it to finish")
        if self.controller_gone():
            warnings.warn("the pool's controller died; starting a new pool of "
                          f"{self.world_size} ranks")
            await self._new_pool()
            return self.caller
        if self.caller.pending and not (self.owned and self.dead_ranks()):
            # Peers of a failed rank leave their collective within the collective timeout of the
            # failure; a rank still busy after that is hung: a pool we own replaces it. (When a
            # rank died, recover replaces its stuck peers at once instead of waiting.)
            left = self.caller.failed_at + self.patience - time.monotonic()
            stuck = await self.caller.drain(max(0.0, left),
                                            extend=self.collective_timeout + STUCK_MARGIN_S if self.patience else 0.0)
            if stuck:
                if not self.owned:
                    raise SessionError(f"rank(s) {stuck} are still busy with an earlier call; restart their "
                                       "engines in the cluster, then call restart_ranks()")
                warnings.warn(f"rank(s) {stuck} did not finish the last call: replacing them")
                await self._kill([self.places[r].pid for r in stuck])
        dead = self.dead_ranks()
        if dead:
            if not self.owned:
                raise SessionError(f"rank(s) {dead} died; restart their engines in the cluster, then "
                                   "call restart_ranks()")
            warnings.warn(f"rank(s) {dead} died; starting replacements")
            await self.recover(replace=len(dead))
        elif self.dirty:
            await self.recover()
        return self.caller

    async def call(self, fn: Callable, args: Sequence[Any] = (), kwargs: dict | None = None, *,
                   ranks: Sequence[int] | None = None, per_rank: Callable[[int], tuple[tuple, dict]] | None = None,
                   what: str = "call", timeout: float | None = None) -> list:
        """fn on every rank (or `ranks`); the results in rank order. Used on a caller already
        `require`d (or while connecting)."""
        caller = self.caller
        return await self._guarded(caller, caller.wait(
            caller.submit(fn, args, kwargs, ranks=ranks, per_rank=per_rank), timeout or self.timeout, what))

    async def stream(self, fn: Callable, args: Sequence[Any], on_item: Callable[[int, Any], None], *,
                     what: str, timeout: float | None = None, stop: threading.Event | None = None) -> list:
        """fn on every rank, each record it publishes handed to `on_item(rank, record)` as it comes.
        `stop`, once set (also before the call reaches the ranks), ends it at the ranks' next boundary."""
        caller = await self.require()
        self.fired = []

        def take(rank: int, item: Any) -> None:
            if isinstance(item, FaultSpec):  # an injected fault announcing itself as it fires
                offset = self.clock_offsets().get(rank, 0.0)
                self.fired.append(dataclasses.replace(item, time=item.time - offset))
            else:
                on_item(rank, item)

        submitted = caller.submit(fn, args)
        self.running = submitted
        if stop is not None and stop.is_set():
            caller.abort(submitted)
        try:
            due = (lambda: announcement_due(self)) if self.faults else None
            return await self._guarded(caller, caller.stream(submitted, take, timeout or self.timeout, what,
                                                             stall=self.collective_timeout + STUCK_MARGIN_S, due=due))
        finally:
            self.running = None
            self.faults = []  # armed for this call only (the ranks forget them too)

    async def _guarded(self, caller: RankCaller, waiting) -> list:
        """A call's results; on failure the ranks are marked for a re-formed group when the group
        is no use any more, and the error names what happened (cluster/diagnose.py)."""
        try:
            return await waiting
        except RankError as exc:
            self.dirty = diagnose.group_broken(exc, bool(caller.pending)) or self.dirty
            found = diagnose.explain(exc, await gather_evidence(self, exc))
            self.patience = found.patience
            raise found.error from exc
        except RankTimeout:
            self.dirty = bool(caller.pending) or self.dirty
            self.patience = self.collective_timeout + STUCK_MARGIN_S
            if self.controller_gone():
                raise SessionError("the pool's ipyparallel controller is gone, so no call reaches the ranks; "
                                   "the next call starts a new pool and resumes from the newest snapshot") from None
            raise

    def abort(self) -> bool:
        """Ask the ranks to stop the streaming call at its next boundary; False if none runs."""
        running = self.running
        if running is None or self.caller is None:
            return False
        self.caller.abort(running)
        return True

    async def inject(self, fault: FaultSpec) -> FaultSpec:
        """Arm `fault` on its rank (checked here first: nothing is sent for a bad one)."""
        from ..runtime.rank.faults import KINDS, PLACES

        check_fault(fault, self.world_size, KINDS, PLACES)
        await self.require()
        await self.call(api.inject, (fault,), ranks=[fault.rank], what="inject")
        self.faults.append(fault)
        return fault

    # ---- processes ---------------------------------------------------------------------------------
    async def _kill(self, pids: list[int]) -> None:
        """SIGKILL engines of our own pool; their ranks count as dead from then on."""
        import signal

        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        doomed = {p.rank for p in self.places if p.pid in pids}
        for _ in range(200):  # SIGKILL ends a process within milliseconds
            if doomed <= set(self.dead_ranks()):
                break
            await asyncio.sleep(0.05)
        self.mark_gone(sorted(doomed))
        self.caller.pending = []

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine is gone (killed, out of memory, crashed): the controller dropped it,
        or, in a pool we started on this machine, its process no longer runs (seen at once; the
        controller's heartbeat takes a second or two). Every rank, once our controller is gone:
        no call reaches any of them."""
        if self.pool is None or self.caller is None or self.pool.client is None:
            return []
        if self.controller_gone():
            return list(range(self.world_size))
        alive = set(self.pool.client.ids)
        return [r for r, eid in enumerate(self.caller.engine_ids)
                if eid not in alive or eid in self._gone_engines or self._process_gone(r)]

    def _process_gone(self, rank: int) -> bool:
        return self.owned and rank < len(self.places) and process_gone(self.places[rank].pid)

    def controller_pid(self) -> int | None:
        return self.pool.controller_pid() if self.pool is not None else None

    def controller_gone(self) -> bool:
        """The controller of a pool we started has ended (nothing reaches the ranks through it)."""
        pid = self.controller_pid() if self.owned else None
        return pid is not None and process_gone(pid)

    def mark_gone(self, ranks: Sequence[int]) -> None:
        """These ranks' processes are gone: connect must not pick their engines again."""
        self._gone_engines |= {self.caller.engine_ids[r] for r in ranks}

    def local_pids(self) -> list[int]:
        """Pids of the ranks' processes (on this host when the pool is ours)."""
        return [p.pid for p in self.places]

    # ---- recovery ----------------------------------------------------------------------------------
    async def recover(self, replace: int = 0) -> None:
        """After a failure that may have left collectives half-done, or a dead rank: a fresh
        process group (with new engines for dead ones and, in a pool we own, for survivors still
        stuck in the failed call: gloo cannot abort them), the model laid out again by the
        relayout collaborator."""
        self.dirty = False
        dead = set(self.dead_ranks())
        stuck = sorted({r for r, ar in self.caller.pending if not ar.done()} - dead)
        if dead and stuck and self.owned:
            await self._kill([self.places[r].pid for r in stuck])
            dead |= set(stuck)
            replace += len(stuck)
        self.caller.pending = []
        self.mark_gone(sorted(dead))
        survivors = [r for r in range(self.world_size) if r not in dead]
        if self.relayout is not None:
            await self.relayout.before_reform(self, survivors)
        if replace or dead:
            if replace:
                self.pool.add_engines(replace, timeout=self.timeout)
            await self.connect(expected=None)
        else:
            await self.form_group()
        if self.relayout is not None:
            await self.relayout.after_reform(self, bool(replace or dead))

    async def _new_pool(self) -> None:
        """Our controller died: every engine is cut off from us. Stop what is left of the old
        pool (its engines, orphans now) and start a pool of the same size; the relayout then
        restores the newest snapshot."""
        old, world = self.pool, self.world_size
        self.caller = self.view = None
        self.running, self.dirty, self._gone_engines = None, False, set()
        old.stop()
        self.pool = LocalPool(world, timeout=self.timeout, launch=getattr(old, "launch", None))
        await self.connect(expected=world)
        if self.relayout is not None:
            await self.relayout.after_reform(self, True)

    async def restart(self) -> None:
        """Replace dead ranks (local pool) or pick up the engines now in the cluster (attached)."""
        if self.pool is None:
            raise SessionError("the session is stopped")
        if self.controller_gone():
            await self._new_pool()
            return
        await self.recover(replace=len(self.dead_ranks()) if self.owned else 0)

    # ---- actions --------------------------------------------------------------------------------
    async def doctor(self) -> RecordList:
        caller = await self.require()
        rows = await self.call(api.doctor, per_rank=lambda r: ((caller.engine_ids[r],), {}), what="doctor",
                               timeout=self.collective_timeout + 10)
        return RecordList(rows, columns=DOCTOR_COLUMNS)

    async def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        await self.require()
        await self._make_importable(fn)
        return await self.call(fn, args, kwargs, what=getattr(fn, "__name__", "run"), timeout=timeout)

    async def _make_importable(self, fn: Callable) -> None:
        """A module-level function ships by reference: its script's folder goes on the ranks' sys.path."""
        folder = engine_side.folder_to_import(fn)
        if folder is not None and folder not in self._paths:
            await self.call(engine_side.add_sys_path, (folder,), what="sys.path")
            self._paths.add(folder)


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None
