"""The Session's view inside the ranks: memory, comms, layout, timeline, predictions, debug mode.

Owns keeping the probe records that arrive with each step (the last TELEMETRY_STEPS
steps, per kind) and the public methods that return them as RecordLists. A mixin of
Session: it uses the session's rank caller, plan and spec, and adds no state beyond
`_telemetry`. Knows nothing of how ranks measure (runtime/probes) or estimate
(plan/estimate); never imports torch.
"""
from __future__ import annotations

from collections import deque
from typing import Any

from ..plan import Plan
from ..records import CommRecord, MemoryRecord, PipelineEvent, RecordList, ShardRecord, from_dict
from ..runtime import api
from ._sync import run_sync
from .errors import SessionError

TELEMETRY_STEPS = 20
MEMORY_COLUMNS = ("rank", "step", "params", "grads", "optimizer", "activations", "rss")
COMM_COLUMNS = ("rank", "step", "op", "bytes", "dtype", "axis", "group", "peer", "start", "end")
SHARD_COLUMNS = ("param", "rank", "stage", "coords", "placements", "global_shape", "local_shape", "index")
TIMELINE_KINDS = (CommRecord, PipelineEvent)


class TelemetryMixin:
    """Session methods over the ranks' probes (see runtime/probes for what is measured)."""

    @property
    def _tele(self) -> deque:
        if "_telemetry" not in self.__dict__:
            self.__dict__["_telemetry"] = deque(maxlen=TELEMETRY_STEPS)
        return self.__dict__["_telemetry"]

    def _keep_telemetry(self, per_rank: list[list[dict]]) -> None:
        """Records of one step from every rank (the non-'step' kinds); oldest steps fall off."""
        kept = [from_dict(d) for rank_records in per_rank for d in rank_records
                if d.get("kind") in ("memory", "comm", "pipeline")]
        if kept:
            self._tele.append(kept)

    def _latest(self, kinds: tuple[type, ...], steps: int | None) -> list:
        """Records of `kinds` from the last `steps` recorded steps (None: the latest one)."""
        chosen = list(self._tele)[-(steps or 1):]
        return [r for step in chosen for r in step if isinstance(r, kinds)]

    def memory(self) -> RecordList:
        """Per rank, bytes of params / grads / optimizer state / activation peak of the latest
        step, measured; `.predicted` holds plan/estimate's MemoryRecords for the same plan."""
        out = RecordList(self._latest((MemoryRecord,), 1), columns=MEMORY_COLUMNS)
        out.predicted = self.predict_memory() if self.spec is not None and self.plan is not None else RecordList()
        return out

    def predict_memory(self, plan: Plan | None = None) -> RecordList:
        """Predicted MemoryRecords per rank (step -1) for `plan` (default: the current one);
        needs no rank to have run it."""
        from ..plan.estimate import predict_memory

        plan = plan or self.plan or Plan(dp=self.world_size, device=self.device)
        if self.spec is None:
            raise SessionError("no model loaded: call load_model('tiny-llama') first")
        return RecordList(predict_memory(self.spec, plan), columns=MEMORY_COLUMNS[:-1])

    def predict_comms(self, plan: Plan | None = None) -> list[dict[str, Any]]:
        """Predicted bytes per step per (op, mesh axis) on each rank (plan/estimate)."""
        from ..plan.estimate import predict_comms

        if self.spec is None:
            raise SessionError("no model loaded: call load_model('tiny-llama') first")
        return predict_comms(self.spec, plan or self.plan or Plan(dp=self.world_size, device=self.device))

    def comms(self, steps: int | None = None) -> RecordList:
        """Every collective and p2p op each rank issued in the latest step (or the last
        `steps` steps): op, bytes (full-buffer convention), dtype, mesh axis, group, peer,
        start/end host times."""
        return RecordList(self._latest((CommRecord,), steps), columns=COMM_COLUMNS)

    def timeline(self, steps: int | None = None) -> RecordList:
        """Comm intervals (CommRecords) and compute intervals (PipelineEvents: forward /
        backward per stage and microbatch) of the latest step (or the last `steps`)."""
        return RecordList(self._latest(TIMELINE_KINDS, steps))

    async def layout_async(self) -> RecordList:
        caller = self._require()
        if self.plan is None:
            raise SessionError("no plan applied: call apply(plan) first")
        per_rank = await self._wait_async(caller.submit(api.layout), "layout")
        return RecordList([ShardRecord.from_dict(d) for rank_records in per_rank for d in rank_records],
                          columns=SHARD_COLUMNS)

    def layout(self) -> RecordList:
        """Per parameter and rank: placements, mesh coordinates, pipeline stage and the
        [start, stop) index ranges of the full tensor the rank holds."""
        return run_sync(self.layout_async())

    def set_probes(self, flag: bool) -> None:
        """Per-step probes on (default) or off on every rank."""
        self._wait(self._require().submit(api.set_probes, (bool(flag),)), "set_probes")

    def set_debug(self, flag: bool = True) -> None:
        """Re-initialise the process group with TORCH_DISTRIBUTED_DEBUG=DETAIL (or back to
        OFF): a collective whose shapes differ across ranks then raises an error naming the
        ranks, op and shapes instead of aborting the engines. Slower collectives; the
        weights carry over (gathered first), the optimizer state and step count restart."""
        if flag:
            self._check_debug_plan(self.plan)
        caller = self._require()
        self._wait(caller.submit(api.set_debug, (bool(flag),)), "set_debug", timeout=self.collective_timeout + 10)
        self._init_process_group()
        self._wait(caller.submit(api.restore_debug_carry), "set_debug")
        if self.spec is not None and self.plan is not None:
            self._wait(caller.submit(api.apply_plan, (self.plan.to_dict(),)), "apply")
        self.debug = bool(flag)

    def _check_debug_plan(self, plan: Plan | None) -> None:
        """DDP segfaults the engines when its group is a DETAIL debug wrapper (measured, torch
        2.13 CPU: constructing DistributedDataParallel dies with SIGSEGV); refuse it here."""
        if plan is not None and plan.dp > 1 and plan.world_size == plan.dp and \
                (getattr(self, "debug", False) or plan is self.plan):
            raise SessionError(f"debug mode cannot run plan {plan.describe()}: DDP crashes under "
                               "TORCH_DISTRIBUTED_DEBUG=DETAIL on this torch; use Plan(fsdp=...) "
                               "(or dp combined with another axis) while debugging")
