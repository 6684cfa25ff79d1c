"""The boundary every long loop crosses between two steps, on one rank.

Owns `Boundary`: a loop's records go out as they happen (kept for the call's return when no
driver listens), the ranks' stop agreement is read (a vote cast during the step just run,
runtime.rank.channel.cast_stop_vote, else one agreement now) and, when they go on, the faults
armed for the next step fire (runtime.rank.faults). A new loop crosses a Boundary; it never
rolls its own. Declared here, below every loop that crosses one (training's in runtime.loop,
the serving engines in runtime.inference), so those loops need not import the module that
calls them. Knows nothing of what a step does, of ipyparallel or of the client: what listens
is runtime.rank.channel's business, and runtime.loop.long_call makes each call's Boundary.
"""
from __future__ import annotations

from typing import Any

from . import channel, faults


class Boundary:
    """One long call's crossing between steps, on one rank (long_call makes it)."""

    def __init__(self, device: Any = "cpu"):
        self.device = device
        self.kept: list = []
        """The records no driver took: the call returns them."""
        self._vote: Any = None
        self._cast = False

    @property
    def streaming(self) -> bool:
        """Whether a driver listens (a record only it would read need not be built otherwise)."""
        return channel.streaming()

    def send(self, record: Any, keep: bool = True) -> None:
        """Hand `record` to the driver now; when none listens, keep it for the call's return
        (`keep=False`: drop it, for records that only matter live, such as streamed tokens)."""
        if not channel.emit(record) and keep:
            self.kept.append(record)

    def cast(self) -> None:
        """Cast this rank's stop vote without waiting for it; the next crossing reads it. A
        training step calls this once its gradients are ready (train_step's after_backward)."""
        self._vote, self._cast = channel.cast_stop_vote(self.device), True

    def stop(self, finished: bool | None = None) -> bool:
        """True on every rank when the ranks agree to stop here: the vote cast during the step
        just run, else one agreement now (with `finished`: also when every rank has finished)."""
        if self._cast:
            vote, self._vote, self._cast = self._vote, None, False
            return channel.read_stop_vote(vote)
        return channel.agree_stop(self.device, finished)

    def fire(self) -> None:
        """Fire the faults armed for the step that starts, agreeing nothing: before a loop's
        first step (generate), or in a loop that agrees on stopping its own way (serving)."""
        faults.boundary()

    def cross(self, *records: Any, finished: bool | None = None) -> bool:
        """Between two steps: `records` out, the stop agreement read (see `stop`) and, when the
        ranks go on, the faults armed for the next step fired. True: stop here."""
        for record in records:
            self.send(record)
        if self.stop(finished):
            return True
        faults.boundary()
        return False

    def close(self) -> None:
        """Complete a vote still in flight: every rank cast it, so every rank waits for it."""
        if self._cast:
            self.stop()
