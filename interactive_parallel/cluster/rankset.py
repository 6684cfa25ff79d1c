"""The rank set: engines of an ipyparallel pool joined in one torch.distributed process group.

Owns the pool's lifetime (stop leaves nothing behind), the rank assignment (stable, with
per-host local ranks), each rank's clock offset from this client's (measured at connect),
the rendezvous (on loopback for one host; across hosts on the interface the user names or,
by default, the one rank 0 reaches the controller through), every remote call with its
timeout (one long call at a time may stream records back and be stopped), and recovery
after a failed collective or a dead rank: a fresh process group and replacement engines.
It knows nothing of models, plans or training: whoever lays a model out on the ranks gives
it a `Relayout` hook, called around every re-formed group. `doctor()` and `run()` live here; never imports torch.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
import warnings
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from ..records import ClockRecord, FaultSpec, RecordList
from ..runtime import api, net
from . import engine_side
from .calls import RankCaller, Submitted
from .errors import RankError, RankTimeout, SessionError
from .pool import Pool

DEATH_WAIT_S = 4.0
"""After a peer's connection dropped, how long to look for a dead engine behind it (on another
host only the controller's heartbeat sees it; a process of our own pool is seen at once)."""
_LOST = re.compile(r"Connection (reset|closed)|Broken pipe|EOF|Socket closed|peer", re.I)
"""What a rank's error says when a peer's process went away under it."""
_TIMED_OUT = re.compile(r"timed? ?out", re.I)
"""What a rank's error says when it gave up waiting in a collective."""
STUCK_MARGIN_S = 3.0
"""How long after its peers' collectives timed out a rank may still be busy before it counts as
hung: peers blocked in the same step give up within about a step of each other."""
DOCTOR_COLUMNS = ("rank", "host", "pid", "local_rank", "device", "backend", "address", "threads", "torch",
                  "transformers", "barrier_ok", "all_reduce_ok", "bandwidth_gbps", "error")
CLOCK_COLUMNS = ("rank", "host", "offset_s", "rtt_s")
# Round trips per clock measurement: the shortest one gives the offset (its error is at most
# half that trip), so a few rounds ride out a scheduling hiccup of the client or an engine.
CLOCK_ROUNDS = 5


class Relayout(Protocol):
    """What a rank set calls around a re-formed process group (the model's owner implements it)."""

    async def before_reform(self, survivors: list[int]) -> None:
        """On the ranks that are alive and idle (`survivors`), before the group is re-formed:
        keep what should outlive it."""

    async def after_reform(self, replaced: bool) -> None:
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
    relayout: Relayout | None = None
    info: list[dict] = field(default_factory=list)
    """Per rank: host, pid, cores, cuda, engine_id, local_rank; interface and address once the
    group is formed (from the ranks themselves)."""
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
    _paths: set[str] = field(default_factory=set)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def connect(self, expected: int | None = None) -> None:
        """Assign ranks, set each one up and form the process group (on a new or re-formed pool)."""
        pool = self.pool
        ids = [e for e in pool.engine_ids if e not in self._gone_engines]
        if expected is not None and len(ids) != expected:
            raise SessionError(f"pool has {len(ids)} engines, expected {expected}")
        probe = RankCaller(pool.client, ids)
        facts = await probe.wait(probe.submit(api.identify), self.timeout, "identify")
        # Stable order: hosts in order of their lowest engine id, engine ids within a host,
        # so a host's ranks are contiguous (TP, the innermost mesh axis, stays on one host).
        hosts = list(dict.fromkeys(f["host"] for f in facts))
        order = sorted(range(len(ids)), key=lambda i: (hosts.index(facts[i]["host"]), ids[i]))
        ids, facts = [ids[i] for i in order], [facts[i] for i in order]
        if self.device == "cuda":
            short = [f"{f['host']} has {f['cuda']} GPU(s)" for f in facts if f["cuda"] == 0]
            if short:
                raise SessionError("device 'cuda' asked for, but " + "; ".join(sorted(set(short))))
        local: dict[str, int] = {}
        self.info = []
        for rank, f in enumerate(facts):
            self.info.append(dict(f, rank=rank, engine_id=ids[rank], local_rank=local.setdefault(f["host"], 0)))
            local[f["host"]] += 1
        if self.device == "cuda":
            over = [f"{h}: {n} ranks > {min(f['cuda'] for f in facts if f['host'] == h)} GPUs"
                    for h, n in local.items() if n > min(f["cuda"] for f in facts if f["host"] == h)]
            if over:
                raise SessionError("one GPU per local rank needed; " + "; ".join(over))
        self.caller = RankCaller(pool.client, ids, [f["host"] for f in facts], dead=self.dead_ranks)
        self.view = pool.client[ids]
        self.view.block = True  # %px cells show each rank's output when they finish
        world = len(ids)
        await self.call(api.setup, per_rank=lambda r: (
            (r, world, self.info[r]["local_rank"], local[self.info[r]["host"]], self.threads), {}), what="setup")
        await self.call(engine_side.install, what="setup")
        await self.call(_define_px_names, what="setup")
        await self.measure_clocks()
        await self.form_group()
        if _in_ipython():
            self.view.activate()  # %px / %%px in this IPython kernel now reach the ranks

    async def measure_clocks(self, rounds: int = CLOCK_ROUNDS) -> list[ClockRecord]:
        """Each rank's clock offset from this client's, NTP-style: the rank's time.time() against
        the midpoint of the round trip that fetched it, from the round with the shortest trip."""
        best: dict[int, tuple[float, float]] = {}
        for _ in range(rounds):
            t0 = time.time()
            remote = await self.call(api.wall_clock, what="clock")
            t1 = time.time()
            for rank, t in enumerate(remote):
                if rank not in best or t1 - t0 < best[rank][1]:
                    best[rank] = (t - (t0 + t1) / 2, t1 - t0)
        self.clocks = [ClockRecord(rank=r, host=self.info[r]["host"], offset_s=o, rtt_s=rtt)
                       for r, (o, rtt) in sorted(best.items())]
        return self.clocks

    def clock_offsets(self) -> dict[int, float]:
        """Rank -> seconds its clock is ahead of this client's."""
        return {c.rank: c.offset_s for c in self.clocks}

    async def form_group(self) -> None:
        """Rendezvous: rank 0 opens the store on its chosen address (runtime.net), every rank joins."""
        hosts = list(dict.fromkeys(r["host"] for r in self.info))
        if self.interface:
            await self._check_interface(self.interface)
        toward = None
        if self.interface is None and len(hosts) > 1:
            (toward,) = await self.call(engine_side.controller_address, ranks=[0], what="rendezvous")
        (addr, port), = await self.call(api.master_endpoint, (self.interface, toward), ranks=[0], what="rendezvous")
        if len(hosts) > 1 and net.is_loopback(addr):
            await self.call(api.release_endpoint, ranks=[0], what="rendezvous")
            how = f"interface {self.interface!r}" if self.interface else f"its route to the controller at {toward}"
            raise SessionError(f"rank 0 (host {hosts[0]}) would rendezvous on loopback {addr} ({how}), which "
                               f"the ranks on {', '.join(hosts[1:])} cannot reach: name the interface the hosts "
                               "reach each other through, e.g. Session.attach(..., interface='eth0')")
        joined = await self.call(api.init_process_group, (addr, port, self.device, self.collective_timeout,
                                                          self.interface),
                                 what="init_process_group", timeout=self.collective_timeout + 10)
        for info, j in zip(self.info, joined):
            info.update(interface=j["interface"], address=j["address"])

    async def _check_interface(self, interface: str) -> None:
        """Every rank has an IPv4 address on `interface`, or SessionError naming those without."""
        found = await self.call(api.network, (interface,), what="rendezvous")
        missing = [f"rank {r} on {f['host']} (interfaces: {', '.join(f['interfaces'])})"
                   for r, f in enumerate(found) if not f["address"]]
        if missing:
            raise SessionError(f"interface {interface!r} has no IPv4 address on " + "; ".join(missing))

    @property
    def world_size(self) -> int:
        return len(self.caller.engine_ids) if self.caller else 0

    @property
    def alive(self) -> bool:
        return self.pool is not None and self.caller is not None

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
        """The caller, after bringing the ranks back into shape if the last call left them out of it."""
        if self.pool is None or self.caller is None:
            raise SessionError("the session is stopped")
        if self.running is not None:
            raise SessionError("the ranks are busy with a running call (train/generate): interrupt() it "
                               "or wait for it to finish")
        if self.caller.pending and not (self.pool.owned and self.dead_ranks()):
            # Peers of a failed rank leave their collective within the collective timeout of the
            # failure; a rank still busy after that is hung: a pool we own replaces it. (When a
            # rank died, recover replaces its stuck peers at once instead of waiting.)
            left = self.caller.failed_at + self.patience - time.monotonic()
            stuck = await self.caller.drain(max(0.0, left),
                                            extend=self.collective_timeout + STUCK_MARGIN_S if self.patience else 0.0)
            if stuck:
                if not self.pool.owned:
                    raise SessionError(f"rank(s) {stuck} are still busy with an earlier call; restart their "
                                       "engines in the cluster, then call restart_ranks()")
                warnings.warn(f"rank(s) {stuck} did not finish the last call: replacing them")
                await self._kill([self.info[r]["pid"] for r in stuck])
        dead = self.dead_ranks()
        if dead:
            if not self.pool.owned:
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
            return await self._guarded(caller, caller.stream(submitted, take, timeout or self.timeout, what,
                                                             stall=self.collective_timeout + STUCK_MARGIN_S))
        finally:
            self.running = None
            self.faults = []  # armed for this call only (the ranks forget them too)

    async def _guarded(self, caller: RankCaller, waiting) -> list:
        """A call's results; on failure the ranks are marked for a re-formed group (when some were
        left running) and the error says what happened (`_explain`)."""
        try:
            return await waiting
        except RankError as exc:
            # A rank left running, or any that gave up on a collective or lost a peer: gloo's
            # pairs are closed after a timeout, so the group is no use even when every rank
            # has returned (all timed out together).
            broken = any(_TIMED_OUT.search(x) or _LOST.search(x) for x in _said(exc))
            self.dirty = bool(caller.pending) or broken or self.dirty
            self.patience = self.collective_timeout + STUCK_MARGIN_S
            raise await self._explain(exc) from exc
        except RankTimeout:
            self.dirty = bool(caller.pending) or self.dirty
            self.patience = self.collective_timeout + STUCK_MARGIN_S
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
        from ..runtime.faults import KINDS, PLACES

        def whole(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        problems = []
        if not whole(fault.rank) or not fault.rank < self.world_size:
            problems.append(f"rank({fault.rank!r}) is not one of 0..{self.world_size - 1}")
        if fault.fault not in KINDS:
            problems.append(f"fault {fault.fault!r} is not one of {', '.join(KINDS)}")
        if fault.where not in PLACES:
            problems.append(f"where {fault.where!r} is not one of {', '.join(PLACES)}")
        if not whole(fault.at_step):
            problems.append(f"at_step({fault.at_step!r}) must be a whole number >= 0")
        if not whole(fault.collective):
            problems.append(f"collective({fault.collective!r}) must be a whole number >= 0")
        if not isinstance(fault.seconds, (int, float)) or isinstance(fault.seconds, bool) or fault.seconds < 0:
            problems.append(f"seconds({fault.seconds!r}) must be a number >= 0")
        if problems:
            raise ValueError("; ".join(problems))
        await self.require()
        await self.call(api.inject, (fault,), ranks=[fault.rank], what="inject")
        self.faults.append(fault)
        return fault

    # ---- failures ----------------------------------------------------------------------------------
    async def _explain(self, exc: RankError) -> RankError:
        """The error to show for a failed call. When a rank died, its peers' "connection closed"
        came first: name the dead rank instead. When the peers gave up waiting in a collective,
        the rank they waited for is the one still running once the other blocked peers have
        timed out too (STUCK_MARGIN_S): name it as hung; when all timed out together, the one
        that announced skipping a collective. Either way, name the injected fault behind it,
        if one fired or was armed."""
        import asyncio

        dead = self.dead_ranks()
        said = _said(exc)
        if not dead and any(_LOST.search(x) for x in said):
            for _ in range(int(DEATH_WAIT_S / 0.05)):  # another host's death: the heartbeat tells
                dead = self.dead_ranks()
                if dead or self.caller is None:
                    break
                await asyncio.sleep(0.05)
        timed_out = exc.ename == "RankHung" or any(_TIMED_OUT.search(x) for x in said)
        if dead:
            self._gone_engines |= {self.caller.engine_ids[r] for r in dead}
        if dead and exc.rank not in dead:
            others = {**exc.others, exc.rank: f"{exc.ename}: {(exc.evalue.splitlines() or [''])[0][:200]}"}
            exc = RankError(dead[0], "EngineDied", f"the process of rank {dead[0]} is gone (killed, out of memory "
                            "or crashed); its peers lost their connections", "", host=self.caller.hosts[dead[0]],
                            what=exc.what, others=others, stuck=[r for r in exc.stuck if r not in dead])
        elif not dead and timed_out and exc.stuck and exc.ename != "RankHung":
            exc = await self._name_hung(exc)
        if not dead and timed_out and exc.ename not in ("RankHung", "SkippedCollective"):
            exc = self._name_skipper(exc)
        if timed_out and not dead:
            self.patience = 0.0 if exc.ename == "RankHung" else STUCK_MARGIN_S
        named = {exc.rank, *exc.stuck, *exc.others}
        culprits = [f for f in self.fired if f.rank in named] or self.fired or \
            [f for f in self.faults if f.rank in named] or self.faults
        if culprits:
            exc = exc.with_fault("; ".join(f.describe() for f in culprits))
        return exc

    def _name_skipper(self, exc: RankError) -> RankError:
        """Every rank timed out together (none was left running to name as hung): when one of
        them announced that it skipped a collective (an injected fault), that rank is the one
        they all waited for, whichever of them failed first."""
        skipped = [f.rank for f in self.fired if f.fault == "skip_collective"]
        if not skipped or skipped[0] == exc.rank:
            return exc
        rank = skipped[0]
        others = {exc.rank: f"{exc.ename}: {(exc.evalue.splitlines() or [''])[0][:200]}", **exc.others}
        others.pop(rank, None)
        return RankError(rank, "SkippedCollective", f"rank {rank} skipped a collective its peers issued, so every "
                         f"rank's later collectives were mismatched and timed out ({self.collective_timeout:g} s)",
                         "", host=self.caller.hosts[rank], what=exc.what, others=others, stuck=exc.stuck)

    async def _name_hung(self, exc: RankError) -> RankError:
        """Peers timed out in a collective: wait (up to STUCK_MARGIN_S) for the other blocked
        ones to time out too; the ranks then still running are the ones they waited for."""
        import asyncio

        from .errors import remote_error_fields

        pending = self.caller.pending
        deadline = time.monotonic() + STUCK_MARGIN_S
        while time.monotonic() < deadline and sum(not ar.done() for _, ar in pending) > 1:
            await asyncio.sleep(0.05)
        hung = [r for r, ar in pending if not ar.done()]
        if not hung:
            return exc
        others = {exc.rank: f"{exc.ename}: {(exc.evalue.splitlines() or [''])[0][:200]}", **exc.others}
        for r, ar in pending:
            if ar.done() and ar.exception() is not None:
                e, v, _ = remote_error_fields(ar.exception())
                others[r] = f"{e}: {(v.splitlines() or [''])[0][:200]}"
        self.caller.pending = [(r, ar) for r, ar in pending if not ar.done()]
        return RankError(hung[0], "RankHung", f"rank {hung[0]} was still running {exc.what} after its peers "
                         f"gave up waiting for it in a collective ({self.collective_timeout:g} s): it hung, "
                         "or never reached that collective", "", host=self.caller.hosts[hung[0]], what=exc.what,
                         others=others, stuck=hung[1:])

    async def _kill(self, pids: list[int]) -> None:
        """SIGKILL engines of our own pool; their ranks count as dead from then on."""
        import asyncio
        import signal

        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        doomed = {r for r, i in enumerate(self.info) if i["pid"] in pids}
        for _ in range(200):  # SIGKILL ends a process within milliseconds
            if doomed <= set(self.dead_ranks()):
                break
            await asyncio.sleep(0.05)
        self._gone_engines |= {self.caller.engine_ids[r] for r in doomed}
        self.caller.pending = []

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine is gone (killed, out of memory, crashed): the controller dropped it,
        or, in a pool we started on this machine, its process no longer runs (seen at once; the
        controller's heartbeat takes a second or two)."""
        if self.pool is None or self.caller is None or self.pool.client is None:
            return []
        alive = set(self.pool.client.ids)
        return [r for r, eid in enumerate(self.caller.engine_ids)
                if eid not in alive or eid in self._gone_engines or self._process_gone(r)]

    def _process_gone(self, rank: int) -> bool:
        if not self.pool.owned or rank >= len(self.info):
            return False
        from .pool import process_gone

        return process_gone(self.info[rank]["pid"])

    async def recover(self, replace: int = 0) -> None:
        """After a failure that may have left collectives half-done, or a dead rank: a fresh
        process group (with new engines for dead ones and, in a pool we own, for survivors still
        stuck in the failed call: gloo cannot abort them), the model laid out again by the
        relayout hook."""
        self.dirty = False
        dead = set(self.dead_ranks())
        stuck = sorted({r for r, ar in self.caller.pending if not ar.done()} - dead)
        if dead and stuck and self.pool.owned:
            await self._kill([self.info[r]["pid"] for r in stuck])
            dead |= set(stuck)
            replace += len(stuck)
        self.caller.pending = []
        self._gone_engines |= {self.caller.engine_ids[r] for r in dead}  # connect must not pick them
        survivors = [r for r in range(self.world_size) if r not in dead]
        if self.relayout is not None:
            await self.relayout.before_reform(survivors)
        if replace or dead:
            if replace:
                self.pool.add_engines(replace, timeout=self.timeout)
            await self.connect(expected=None)
        else:
            await self.form_group()
        if self.relayout is not None:
            await self.relayout.after_reform(bool(replace or dead))

    async def restart(self) -> None:
        """Replace dead ranks (local pool) or pick up the engines now in the cluster (attached)."""
        if self.pool is None:
            raise SessionError("the session is stopped")
        await self.recover(replace=len(self.dead_ranks()) if self.pool.owned else 0)

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
        """ipyparallel ships a module-level function by reference: its module must import on
        the ranks. For a function from a local script or test file, put its folder on the
        ranks' sys.path (once), as a notebook's own functions already travel by value."""
        module = sys.modules.get(getattr(fn, "__module__", "") or "")
        path = getattr(module, "__file__", None)
        if module is None or module.__name__ == "__main__" or not path:
            return
        folder = os.path.dirname(os.path.abspath(path))
        top = module.__name__.split(".")[0]
        if top in sys.stdlib_module_names or top in _IMPORTABLE or folder in self._paths:
            return
        await self.call(_add_sys_path, (folder,), what="sys.path")
        self._paths.add(folder)


_IMPORTABLE = {"interactive_parallel", "torch", "transformers"}


def _add_sys_path(folder: str) -> None:
    import sys

    if folder not in sys.path:
        sys.path.append(folder)


def _define_px_names() -> None:
    """Names a %%px cell finds ready on every rank: torch, dist, rank, world_size, local_rank."""
    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    from interactive_parallel.runtime import state

    st = state.get()
    get_ipython().user_ns.update(torch=torch, dist=dist, rank=st.rank, world_size=st.world_size,
                                 local_rank=st.local_rank)


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _said(exc: RankError) -> list[str]:
    """What every failed rank of `exc` said, the first one's whole error included."""
    return [f"{exc.ename}: {exc.evalue}", *exc.others.values()]
