"""Session: the client's handle on a pool of ranks, from a notebook, a script or the CLI.

Owns the pool's lifetime (start or attach; stop leaves nothing behind), the rank
assignment (stable, per-host local ranks), the process group's rendezvous, the current
model and plan as the client knows them, and every public action (doctor, load_model,
apply, train, generate, run). Async at its core: each action is an `*_async` coroutine
with a blocking twin of the plain name (the names workshops type). Bad input is refused
here, before any rank is touched. Never imports torch at module top: a kernel that only
drives ranks stays light.
"""
from __future__ import annotations

import atexit
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Sequence

from ..plan import ModelSpec, Plan, PlanError, check, resolve_model
from ..records import RankInfo, RecordList, StepRecord
from ..runtime import api
from ._sync import run_sync
from .calls import RankCaller
from .model_ops import ModelOps, VerifyReport  # noqa: F401 - VerifyReport is part of the API
from .errors import RankError, RankTimeout, SessionError
from .pool import AttachedPool, LocalPool, Pool
from .telemetry import TelemetryMixin

_LIVE: "weakref.WeakSet[Session]" = weakref.WeakSet()
STEP_COLUMNS = ("rank", "step", "loss", "tokens", "time_s", "plan")


class Session(ModelOps, TelemetryMixin):
    """Ranks in an ipyparallel pool, each a torch.distributed process, driven from here.

    >>> with Session(ranks=4) as s:
    ...     s.load_model("tiny-llama"); s.apply(Plan(dp=4)); s.train(steps=20)
    """

    def __init__(self, ranks: int = 4, device: str = "cpu", *, threads: int | None = None,
                 timeout: float = 120.0, collective_timeout: float = 60.0, _pool: Pool | None = None):
        if not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks({ranks}) must be a whole number >= 1")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device {device!r} is not 'cpu' or 'cuda'")
        self.device, self.threads = device, threads
        self.timeout, self.collective_timeout = timeout, collective_timeout
        self.spec: ModelSpec | None = None
        self.plan: Plan | None = None
        self.history: RecordList = RecordList(columns=STEP_COLUMNS)
        self.ranks_info: list[dict] = []
        self._interrupt = threading.Event()
        self._busy = threading.Lock()
        self._dirty = False
        self._paths: set[str] = set()
        self._importable = {"interactive_parallel", "torch", "transformers", "builtins", "math", "os"}
        self._caller: RankCaller | None = None
        self._view = None
        self._pool: Pool | None = _pool
        try:
            if self._pool is None:
                self._pool = LocalPool(ranks, timeout=timeout)
            self._connect(expected=ranks if _pool is None else None)
        except BaseException:
            self.stop()
            raise
        _LIVE.add(self)

    @classmethod
    def attach(cls, cluster_id: str = "", profile: str | None = None, *, profile_dir: str | None = None,
               url_file: str | None = None, ranks: int | None = None, device: str = "cpu",
               **kwargs: Any) -> "Session":
        """Use an ipyparallel cluster started elsewhere (e.g. `ipcluster start -n 8 --engines=Slurm`).

        Stopping the session releases the ranks' process group and disconnects; the cluster
        itself keeps running, as it belongs to whoever started it.
        """
        pool = AttachedPool(cluster_id=cluster_id, profile=profile, profile_dir=profile_dir, url_file=url_file,
                            ranks=ranks,
                            timeout=kwargs.get("timeout", 120.0))
        return cls(ranks=ranks or len(pool.engine_ids), device=device, _pool=pool, **kwargs)

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

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._pool is None else f"{self.world_size} ranks on {self.device}"
        model = self.spec.name if self.spec else "no model"
        return f"<Session {state}, {model}, plan {self.plan.describe() if self.plan else 'none'}>"

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

    async def load_model_async(self, model: Any = "tiny-llama") -> ModelSpec:
        spec = resolve_model(model)  # unknown names fail here, before any rank is touched
        if self.plan is not None:
            check(self.plan, self.world_size, spec)
        caller = self._require()
        await self._wait_async(caller.submit(api.load_model, (spec.__dict__,)), "load_model")
        self.spec = spec
        if self.plan is not None:
            await self._wait_async(caller.submit(api.apply_plan, (self.plan.to_dict(),)), "apply")
        return spec

    def load_model(self, model: Any = "tiny-llama") -> ModelSpec:
        """A preset name ('tiny-llama', 'small-llama', 'tiny-gpt2'), a local model directory,
        or a transformers config. Random init from the plan's seed unless weights are given."""
        return run_sync(self.load_model_async(model))

    def check_plan(self, plan: Plan) -> Plan:
        """The plan as this session would run it, or PlanError listing every problem."""
        problems = []
        if plan.device != self.device:
            problems.append(f"plan device {plan.device!r} != session device {self.device!r}")
        try:
            check(plan, self.world_size, self.spec)
        except PlanError as exc:
            problems = exc.problems + problems
        if problems:
            raise PlanError(problems)
        return plan

    async def apply_async(self, plan: Plan) -> Plan:
        self.check_plan(plan)
        if getattr(self, "debug", False):
            self._check_debug_plan(plan)  # DDP dies under the debug wrapper (telemetry.py)
        if self.spec is None:
            raise SessionError("no model loaded: call load_model('tiny-llama') first")
        caller = self._require()
        await self._wait_async(caller.submit(api.apply_plan, (plan.to_dict(),)), "apply")
        self.plan = plan
        return plan

    def apply(self, plan: Plan) -> Plan:
        """Lay the model out under `plan` on the live ranks; the weights carry over."""
        return run_sync(self.apply_async(plan))

    def _training_plan(self, changes: dict[str, Any]) -> Plan:
        if self.spec is None:
            raise SessionError("no model loaded: call load_model('tiny-llama') first")
        base = self.plan or Plan(dp=self.world_size, device=self.device)
        return self.check_plan(base.replace(**{k: v for k, v in changes.items() if v is not None}))

    async def train_async(self, steps: int = 1, *, batch_size: int | None = None, seq_len: int | None = None,
                          grad_accum: int | None = None, lr: float | None = None, precision: str | None = None,
                          on_step: Callable[[list[StepRecord]], None] | None = None) -> RecordList:
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps({steps}) must be a whole number >= 0")
        plan = self._training_plan(dict(batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum, lr=lr,
                                        precision=precision))
        caller = self._require()
        if self.plan is None:
            await self.apply_async(plan)
        elif plan != self.plan:
            await self._wait_async(caller.submit(api.update_training, (plan.to_dict(),)), "update_training")
            self.plan = plan
        self._interrupt.clear()
        out = RecordList(columns=STEP_COLUMNS)
        for _ in range(steps):
            if self._interrupt.is_set():
                break
            per_rank = await self._wait_async(caller.submit(api.train_step), "train_step")
            records = [StepRecord.from_dict(d) for rank_records in per_rank for d in rank_records
                       if d.get("kind") == "step"]
            out.extend(records)
            self.history.extend(records)
            self._keep_telemetry(per_rank)  # memory / comm / pipeline records: memory(), comms(), timeline()
            if on_step is not None:
                on_step(records)
        return out

    def train(self, steps: int = 1, **kwargs: Any) -> RecordList:
        """Run `steps` optimizer steps; returns every rank's StepRecords (also in .history).

        Keyword overrides (batch_size, seq_len, grad_accum, lr, precision) change the plan's
        training knobs, validated before any rank is touched. `interrupt()` stops at the
        next step boundary."""
        return run_sync(self.train_async(steps, **kwargs))

    def panel(self=None):  # noqa: N805 - also called on the class: Session.panel() starts from nothing
        """The JupyterLab control panel for this session (on the class: one whose Cluster section
        starts a session). Every control calls a public method of this class."""
        from ..widgets import panel

        return panel(self)

    def interrupt(self) -> None:
        """Stop a running train() at the next step boundary (safe from another thread)."""
        self._interrupt.set()

    async def generate_async(self, prompts: str | Sequence[str], max_new_tokens: int = 16, *,
                             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                             seed: int = 0) -> list[str]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self._check_prompts(prompts, max_new_tokens, temperature, top_k)
        if self.plan is None:
            await self.apply_async(Plan(dp=self.world_size, device=self.device))
        caller = self._require()
        options = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, seed=seed)
        parts = await self._wait_async(caller.submit(api.generate, (prompts, max_new_tokens, options)), "generate")
        merged: dict[int, str] = {}
        for part in parts:
            for i, text in part.items():
                merged.setdefault(int(i), text)
        return [merged[i] for i in range(len(prompts))]

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 16, **kwargs: Any) -> list[str]:
        """Completions (strings) of one prompt or a list; greedy unless do_sample=True."""
        return run_sync(self.generate_async(prompts, max_new_tokens, **kwargs))

    def _check_prompts(self, prompts: list[str], max_new_tokens: int, temperature: float, top_k: int) -> None:
        problems = []
        if self.spec is None:
            raise SessionError("no model loaded: call load_model('tiny-llama') first")
        if not prompts:
            problems.append("no prompts given")
        if any(not isinstance(p, str) or not p for p in prompts):
            problems.append("every prompt must be a non-empty string")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            problems.append(f"max_new_tokens({max_new_tokens}) must be >= 1")
        elif prompts and all(isinstance(p, str) for p in prompts):
            longest = max(len(p) for p in prompts)  # one token per character
            if longest + max_new_tokens > self.spec.max_positions:
                problems.append(f"longest prompt({longest}) + max_new_tokens({max_new_tokens}) > "
                                f"{self.spec.name} max positions({self.spec.max_positions})")
        if temperature <= 0:
            problems.append(f"temperature({temperature}) must be > 0")
        if top_k < 0:
            problems.append(f"top_k({top_k}) must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))

    def records(self) -> list:
        """Every record the session holds, for reports: steps so far, plus whatever the
        telemetry views return."""
        out = list(self.history)
        for view in ("memory", "comms", "layout", "timeline"):
            fn = getattr(self, view, None)
            if fn is not None and self.plan is not None:
                out += [r for r in fn() if not any(r is o for o in out)]  # comms() and timeline() overlap
        return out

    def report(self, path: str = "report.html", *, title: str = "interactive_parallel report") -> str:
        """Every figure of this session in one standalone HTML file."""
        from ..viz import figures_from_records, write_report

        figures = figures_from_records([r.to_dict() for r in self.records()])
        summary = (f"<p>{self.world_size} ranks on {self.device}; model {self.spec.name if self.spec else '-'}; "
                   f"plan {self.plan.describe() if self.plan else '-'}; {len(self.history)} step records</p>")
        return str(write_report(path, figures, title=title, summary_html=summary))

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
