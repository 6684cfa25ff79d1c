"""LocalSession: the one-process mode behind the calls a lesson makes of a Session (load_model,
apply, train, memory, comms, explain_comms, layout, check_layout, stop), every rank in the
kernel's own process on torch's LocalTensorMode (runtime.client.local.LocalRanks): no engines,
no ports, no threads left at stop, the same records.

Owns the client side of that mode: the plan refused before anything is built (plan.local, pure:
naming the parallelism and what to use instead, the multi-process Session or a dry run), the
records kept as a Session's telemetry keeps them (`history`: every StepRecord, one per rank per
step), and the calls' names. A separate class rather than a Session backend: the Session's
state is its pool (DESIGN: it declares every attribute in one place and is near its size limit),
and none of it applies here. Knows nothing of torch at import: runtime.client.local loads on
the first apply.
"""
from __future__ import annotations

from typing import Any

from ..plan import ModelSpec, Plan, PlanError, check
from ..plan.local import check_local
from ..records import RecordList, StepRecord
from .offline import spec_of


class LocalSession:
    """`ranks` simulated ranks of tensor-parallel plans in this process (LocalTensorMode)."""

    def __init__(self, ranks: int = 4, model: Any = "tiny-llama"):
        if ranks < 1:
            raise ValueError(f"ranks must be at least 1, not {ranks}")
        self.ranks = ranks
        self.spec: ModelSpec | None = None
        self.plan: Plan | None = None
        self.history: RecordList = RecordList()
        self._local = None
        self.load_model(model)

    def load_model(self, model: Any = "tiny-llama") -> ModelSpec:
        """The model every later apply lays out (a preset, a shipped config, a config dict)."""
        self._close()
        self.spec = spec_of(model)
        return self.spec

    def apply(self, plan: Plan) -> Plan:
        """Lay the model out under `plan` on every rank (fresh weights from the plan's seed). A plan
        this mode cannot run, or one whose world is not `ranks`, is refused before anything is built."""
        if plan.world_size != self.ranks:
            raise PlanError([f"{plan.describe()} needs {plan.world_size} ranks; this LocalSession has {self.ranks}"])
        check(plan, self.ranks, self.spec)
        check_local(plan, self.spec)
        from ..runtime.client.local import LocalRanks

        self._close()
        self._local = LocalRanks(self.spec, plan)
        self.plan = plan
        return plan

    def train(self, steps: int = 1) -> RecordList:
        """`steps` optimizer steps of every rank: their StepRecords (also kept in `history`)."""
        out = RecordList(self._require().train(steps))
        self.history.extend(out)
        return out

    def memory(self) -> RecordList:
        """The last step's MemoryRecord of every rank."""
        return self._require().records().memory()

    def comms(self, ranks: Any = None) -> RecordList:
        """The last step's CommRecords of a rank, of several, or (None) of every rank."""
        return self._require().records().comms(ranks)

    def explain_comms(self, rank: int | None = None) -> RecordList:
        return self._require().records().explain_comms(rank)

    def layout(self, rank: int | None = None, param: str | None = None) -> RecordList:
        """ShardRecords: every parameter `rank` holds, `param` on every rank, or (neither) every
        parameter on every rank, as Session.layout()."""
        records = self._require().records()
        if rank is None and param is None:
            return RecordList(s for r in range(self.ranks) for s in records.layout(rank=r))
        return records.layout(rank=rank, param=param)

    def check_layout(self) -> RecordList:
        return self._require().records().lint()

    def steps(self) -> list[StepRecord]:
        return list(self.history)

    def _require(self):
        if self._local is None:
            raise RuntimeError("no plan applied: call apply(plan) first")
        return self._local

    def _close(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None

    def stop(self) -> None:
        """Forget the layout and leave the fake process group (nothing else runs)."""
        self._close()

    def __enter__(self) -> "LocalSession":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        what = self.plan.describe() if self.plan is not None else "no plan"
        return f"<LocalSession {self.ranks} ranks in one process: {self.spec.name if self.spec else None}, {what}>"
