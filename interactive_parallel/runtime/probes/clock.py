"""The probes' clock: marks taken during a step, resolved to host time (time.time) at its end.

Owns what a timestamp of the comm ledger and of the compute intervals means:
- CPU (`HostClock`): a mark is the host time when it was taken; kernels run on the host as
  they are called, so that is when the work around it ran.
- CUDA (`DeviceClock`): the host only queues kernels, so host time around a call is its
  launch. A mark is a timing event recorded on the current stream of the current device
  (runtime.groups.dist sets the rank's device); it resolves to when the device reached that point
  of the stream. At the clock's start a reference event is recorded and waited for and the
  host time taken: a mark's host time is that time plus the device time from the reference
  to the mark. `settle()` waits for the last mark once; `resolve()` then waits only for marks
  of other streams that are still running.

Marks are opaque (a float or an event); what leaves the rank is `resolve(mark)`, a float.
The device clock takes its event factory as a parameter so that its arithmetic runs on CPU
with a stand-in event (one with torch.cuda.Event's record / elapsed_time / synchronize / query).

Does not know: the skew between the host clock and the device's beyond one reference per
step (device time between two marks is the device's own), nor what ran on the stream
between two marks.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch


def cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class HostClock:
    """CPU: a mark is time.time()."""

    def mark(self) -> float:
        return time.time()

    def settle(self) -> None:
        pass

    def resolve(self, mark: float) -> float:
        return float(mark)


class DeviceClock:
    """CUDA: a mark is a timing event on the current stream; `resolve` maps it to host time."""

    def __init__(self, event: Callable[[], Any] | None = None):
        self._new = event if event is not None else cuda_event
        self._ref = self._new()
        self._ref.record()
        # Waited for before the host time is read, so the pair names one instant; the previous
        # step settled its marks, so the device is idle here and the wait costs nothing.
        self._ref.synchronize()
        self._host = time.time()
        self._last = self._ref

    def mark(self) -> Any:
        ev = self._new()
        ev.record()
        self._last = ev
        return ev

    def settle(self) -> None:
        self._last.synchronize()

    def resolve(self, mark: Any) -> float:
        if not mark.query():  # recorded on another stream (a future's callback) and still running
            mark.synchronize()
        return self._host + float(self._ref.elapsed_time(mark)) / 1000.0


Clock = HostClock | DeviceClock


def for_device(device, event: Callable[[], Any] | None = None) -> Clock:
    """The clock of a step on `device`: a DeviceClock on CUDA, the host clock elsewhere."""
    if torch.device(device).type == "cuda":
        return DeviceClock(event)
    return HostClock()
