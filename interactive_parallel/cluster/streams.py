"""Records as they stream from the ranks, put together: a train call's per-rank StepRecords into
whole steps, and an inference call's tokens, requests and decoding steps to their listeners.

Owns the rule that a step is complete when every rank has reported it (and that a failed run
keeps the steps its ranks did report), and moving inference records onto the client's clock as
they arrive. Knows nothing of how records travel (cluster/calls.py) or of models.
"""
from __future__ import annotations

from typing import Any, Callable

from ..records import DecodeStep, RecordList, StepRecord, TokenRecord
from .telemetry import STEP_COLUMNS, Telemetry


class StepAssembler:
    """Per-rank StepRecords -> whole steps, kept in the telemetry store and handed to `on_step`
    while the ranks keep going."""

    def __init__(self, world: int, telemetry: Telemetry,
                 on_step: Callable[[list[StepRecord]], None] | None = None):
        self.world, self.telemetry, self.on_step = world, telemetry, on_step
        self.out = RecordList(columns=STEP_COLUMNS)
        self._waiting: dict[int, dict[int, StepRecord]] = {}

    def _complete(self, batch: list[StepRecord]) -> None:
        self.telemetry.add_step(batch)
        self.out.extend(batch)
        if self.on_step is not None:
            self.on_step(batch)

    def take(self, rank: int, rec: StepRecord) -> None:
        step = self._waiting.setdefault(rec.step, {})
        step[rank] = rec
        if len(step) == self.world:
            self._complete([step[r] for r in sorted(step)])
            del self._waiting[rec.step]

    def close(self) -> RecordList:
        """The steps so far; a failed run's partly reported steps are kept with what came."""
        for step in sorted(self._waiting):
            self._complete([self._waiting[step][r] for r in sorted(self._waiting[step])])
        self._waiting.clear()
        return self.out


class InferenceStream:
    """Tokens, finished requests and decoding steps to their listeners (by record type), times on
    the client's clock; the decoding steps kept for the telemetry store."""

    def __init__(self, telemetry: Telemetry, listeners: dict[type, Callable[[Any], None] | None]):
        self.telemetry, self.listeners = telemetry, listeners
        self.steps: list[DecodeStep] = []

    def take(self, _rank: int, rec: Any) -> None:
        if isinstance(rec, (TokenRecord, DecodeStep)):
            rec = self.telemetry.on_client_clock(rec)  # its time on this client's clock
        if isinstance(rec, DecodeStep):
            self.steps.append(rec)
        listener = self.listeners.get(type(rec))
        if listener is not None:
            listener(rec)
