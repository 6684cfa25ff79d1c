"""Session: the client's handle on a pool of ranks, from a notebook, a script or the CLI.

Owns the current model and plan as the client knows them and the model actions
(load_model, apply, train, generate, report, panel). The rank set (pool, rendezvous,
calls, recovery, doctor, run) is its base `Ranks`; verify/checkpoints/export come from
`ModelOps` and the views inside the ranks from `TelemetryMixin`. Async at its core:
each action is an `*_async` coroutine with a blocking twin of the plain name (the names
workshops type). Bad input is refused here, before any rank is touched. Never imports
torch at module top: a kernel that only drives ranks stays light.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from ..plan import ModelSpec, Plan, PlanError, check, resolve_model
from ..records import RecordList, StepRecord
from ..runtime import api
from ._sync import run_sync
from .errors import SessionError
from .model_ops import ModelOps, VerifyReport  # noqa: F401 - VerifyReport is part of the API
from .pool import AttachedPool, LocalPool, Pool
from .ranks import Ranks
from .telemetry import TelemetryMixin
STEP_COLUMNS = ("rank", "step", "loss", "tokens", "time_s", "plan")


class Session(Ranks, ModelOps, TelemetryMixin):
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
        self._interrupt = threading.Event()
        self._init_ranks(_pool or LocalPool(ranks, timeout=timeout), expected=None if _pool else ranks)

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

    def __repr__(self) -> str:
        state = "stopped" if self._pool is None else f"{self.world_size} ranks on {self.device}"
        model = self.spec.name if self.spec else "no model"
        return f"<Session {state}, {model}, plan {self.plan.describe() if self.plan else 'none'}>"

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
