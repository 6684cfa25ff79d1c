"""The panel's long calls: train, generate and serve run as a Job, one at a time, with Stop.

Owns the Job (a coroutine kept off the kernel's back) and the runner every section that starts
long work is given: it starts `make(session)` as the Job with every control but Stop frozen,
and owns what the runs share (the progress bar, the status line, the Stop button, which
calls `session.interrupt()`, and beside it "Where are the ranks?", which shows
`session.stacks()` and the lanes of `session.collectives()`, live also while a job runs or hangs), the failure path of DESIGN.md (the
remote traceback, naming the rank, in the error area) and the events that say a job started and ended. Knows nothing of
what a job computes nor of how its results are shown: the section that starts one passes its
own `done`.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Coroutine

import ipywidgets as W

from ..viz import collective_lanes_figure
from ._common import Actions, SessionRef, button, css, describe_error, figure_widget, refresh
from .events import Emit, JobEnded, JobKind, JobStarted
from .render import esc, stacks_html


class Job:
    """A coroutine run without blocking whoever started it.

    Inside a notebook kernel (a running asyncio loop) it is a task on that loop: cells and
    widget clicks (the Stop button) keep being served between steps, and its callbacks touch
    widgets from the kernel's own thread. Without a running loop (a script, a test) it runs in
    a thread of its own; `wait()` is for that case only (it would block a kernel's loop).
    """

    def __init__(self, coro: Coroutine, on_done: Callable[[Any, BaseException | None], None]):
        self._on_done = on_done
        self._event = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self.task = loop.create_task(coro)
            self.task.add_done_callback(self._task_done)
            self.thread = None
        else:
            self.task = None
            self.thread = threading.Thread(target=self._thread_main, args=(coro,), daemon=True,
                                           name="interactive-parallel-panel-job")
            self.thread.start()

    def _thread_main(self, coro: Coroutine) -> None:
        try:
            self._finish(asyncio.run(coro), None)
        except BaseException as exc:  # noqa: BLE001 - handed to on_done
            self._finish(None, exc)

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self._finish(None, asyncio.CancelledError("cancelled"))
        else:
            exc = task.exception()
            self._finish(None if exc else task.result(), exc)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self.result, self.error = result, error
        self.finished = True  # before on_done: it re-enables controls and asks whether work runs
        try:
            self._on_done(result, error)
        finally:
            self._event.set()

    @property
    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


LANES = 20
"""Collectives per rank and group the lanes beside the stacks show."""


class JobRunner:
    """Starts the panel's Jobs and shows their progress; its widgets sit in the Run section."""

    def __init__(self, session: SessionRef, actions: Actions, emit: Emit):
        self.session, self.actions, self.emit = session, actions, emit
        self.job: Job | None = None
        self.activity = ""
        """What the running job does ('training', ...); '' when none runs."""
        self.progress = css(W.IntProgress(value=0, min=0, max=1, layout=W.Layout(width="160px")), "ip-run-progress")
        self.status = css(W.HTML(), "ip-run-status")
        self.interrupt = button("Stop", "ip-interrupt-button", style="warning",
                                tooltip="session.interrupt(): stop training, generation or serving at the next "
                                        "boundary")
        self.interrupt.on_click(lambda _b: self.stop())
        actions.register(self.interrupt)
        # Not an action control: asking where the ranks are is most useful while a job runs or hangs.
        self.where = button("Where are the ranks?", "ip-where-button",
                            tooltip="session.stacks(): every rank's Python stack now, also while a call runs")
        self.where_out = css(W.HTML(), "ip-where-output")
        self.where_lanes = figure_widget(collective_lanes_figure([]), "ip-where-lanes-figure", height=300)
        self.where_box = W.Box([self.where_lanes], layout=W.Layout(display="none"))  # shown once asked
        self.where.on_click(lambda _b: self.show_stacks())
        self._asking: Job | None = None

    @property
    def running(self) -> bool:
        """A job is under way (the ranks are busy; Stop is live)."""
        return self.job is not None and not self.job.done

    def start(self, kind: JobKind, make: Callable[[Any], Coroutine], total: int, done: Callable[[Any], None],
              status: str) -> Job | None:
        """Start `make(session)` as a Job with every control but Stop off; None if it cannot start
        (no session, a refused input: shown in the error area)."""
        self.actions.clear()
        try:
            coro = make(self.session.require())
        except Exception as exc:  # noqa: BLE001 - shown in the panel
            self.actions.show(describe_error(exc, kind))
            return None
        self.progress.max, self.progress.value, self.progress.bar_style = max(total, 1), 0, ""
        self.status.value = status
        self.activity = kind.activity
        self.actions.freeze(keep=[self.interrupt])
        self.emit(JobStarted(kind))
        self.job = Job(coro, lambda result, error: self._finish(kind, done, result, error))
        return self.job

    def _finish(self, kind: JobKind, done: Callable[[Any], None], result: Any, error: BaseException | None) -> None:
        try:
            if error is None:
                self.progress.bar_style = "success"
                done(result)
            else:
                self.progress.bar_style = "danger"
                self.actions.show(describe_error(error, kind))
                self.status.value = f"{kind} failed (see above)"
        finally:
            self.activity = ""
            self.emit(JobEnded(kind))

    def advance(self, to: int | None = None) -> None:
        """One more unit done (or `to` units, never going back), capped at the total."""
        value = self.progress.value + 1 if to is None else max(self.progress.value, to)
        self.progress.value = min(value, self.progress.max)

    @property
    def complete(self) -> bool:
        return self.progress.value >= self.progress.max

    def say(self, text: str) -> None:
        self.status.value = text

    def stop(self) -> None:
        if self.session.alive:
            self.session().interrupt()
        self.status.value = "stopping at the next boundary ..."

    def show_stacks(self) -> Job | None:
        """`session.stacks()` and `session.collectives(LANES)` as a Job of its own (the kernel keeps
        serving, a running job goes on); the stacks, or why there are none, replace what where_out
        showed, and the lanes of the group the ranks first disagree on (else the world's) are drawn."""
        if not self.session.alive or (self._asking is not None and not self._asking.done):
            return None
        self.where.disabled = True
        self.where_out.value = "<span class='ip-note'>asking every rank ...</span>"

        def done(result: Any, error: BaseException | None) -> None:
            self.where.disabled = not self.session.alive
            if error is not None:
                self.where_out.value = f"<div class='ip-bad'>{esc(describe_error(error, 'stacks'))}</div>"
                return
            stacks, recent = result
            self.where_out.value = stacks_html(stacks)
            refresh(self.where_lanes, collective_lanes_figure(recent))
            self.where_box.layout.display = ""

        async def ask(session: Any) -> tuple:
            return tuple(await asyncio.gather(session.stacks_async(), session.collectives_async(LANES)))

        self._asking = Job(ask(self.session()), done)
        return self._asking

    def wait(self, timeout: float | None = None) -> bool:
        """Outside a kernel: block until the running job (if any) ends."""
        return True if self.job is None else self.job.wait(timeout)

    def sync(self, alive: bool, busy: bool) -> None:
        self.interrupt.disabled = not (alive and self.running)
        self.where.disabled = not alive or (self._asking is not None and not self._asking.done)
