"""The panel's Cluster section: start, attach to or stop the ranks; per-rank status; doctor.

Owns the controls that create or end a Session (`Session(ranks, device)`, `Session.attach`,
`session.stop()`: the session chosen is an event the panel routes) and the display of
`session.ranks_info` and `session.doctor()`. Knows nothing of plans, models, training or the
other sections (what the ranks are doing comes from the activity getter it is given); the
whether-a-GPU-exists check is made lazily (from the ranks' own report when a session exists,
else torch in this kernel) so importing the panel stays light.
"""
from __future__ import annotations

from typing import Any, Callable

import ipywidgets as W

from ._common import Actions, SessionRef, button, css, row
from .events import Emit, SessionChosen
from .render import doctor_html, note, table

DEVICES = ("cpu", "cuda")


def cuda_unavailable_reason(session: Any = None) -> str:
    """'' when cuda can be offered, else why not (the ranks' GPU counts, or torch in this kernel)."""
    if session is not None and getattr(session, "ranks_info", None):
        short = sorted({r.host for r in session.ranks_info if not r.cuda})
        return f"torch on {', '.join(short)} sees no GPU" if short else ""
    try:
        import torch  # lazily: a kernel that never opens the panel never pays for it
    except ImportError:
        return "torch is not installed in this kernel"
    return "" if torch.cuda.is_available() else "torch in this kernel sees no GPU"


class ClusterSection:
    """Start / Attach / Stop, the status line of each rank, and Doctor."""

    def __init__(self, session: SessionRef, actions: Actions, activity: Callable[[], str], emit: Emit):
        self.session, self.activity, self.emit = session, activity, emit
        current = session()
        self.cuda_reason = cuda_unavailable_reason(current)
        devices = [d for d in DEVICES if d != "cuda" or not self.cuda_reason]
        self.device = css(W.Dropdown(options=devices, value=getattr(current, "device", "cpu"),
                                     description="device", layout=W.Layout(width="160px")), "ip-device")
        self.device_note = css(W.HTML(note(f"cuda disabled: {self.cuda_reason}") if self.cuda_reason else ""),
                               "ip-device-note")
        self.ranks = css(W.IntText(value=getattr(current, "world_size", 0) or 4, description="ranks",
                                   layout=W.Layout(width="140px")), "ip-ranks")
        self.start = button("Start", "ip-start-button", style="success",
                            tooltip="Session(ranks, device): start a local pool of ranks")
        self.cluster_id = css(W.Text(placeholder="cluster id", layout=W.Layout(width="160px")), "ip-cluster-id")
        self.profile = css(W.Text(placeholder="profile", layout=W.Layout(width="120px")), "ip-profile")
        self.attach = button("Attach", "ip-attach-button", tooltip="Session.attach(cluster id, profile)")
        self.stop = button("Stop", "ip-stop-cluster-button", style="danger", tooltip="session.stop()")
        self.doctor = button("Doctor", "ip-doctor-button", tooltip="session.doctor(): versions, barrier, all_reduce")
        self.status = css(W.HTML(), "ip-rank-status")
        self.doctor_out = css(W.HTML(), "ip-doctor-output")
        actions.register(self.device, self.ranks)
        actions.on_click(self.start, "start", self._start)
        actions.on_click(self.attach, "attach", self._attach)
        actions.on_click(self.stop, "stop", self._stop)
        actions.on_click(self.doctor, "doctor", self._doctor)
        self.widget = css(W.VBox([
            W.HTML("<b>Cluster</b>"),
            row(self.device, self.ranks, self.start, self.stop, self.doctor),
            row(self.cluster_id, self.profile, self.attach, self.device_note),
            self.status, self.doctor_out,
        ]), "ip-section", "ip-section-cluster")

    # ---- callbacks (each a public Session call) ------------------------------------------------
    def _start(self) -> None:
        from ..cluster import Session

        self._stop_current()
        self.emit(SessionChosen(Session(ranks=self.ranks.value, device=self.device.value)))

    def _attach(self) -> None:
        from ..cluster import Session

        self._stop_current()
        self.emit(SessionChosen(Session.attach(self.cluster_id.value.strip(), self.profile.value.strip() or None,
                                               device=self.device.value)))

    def _stop_current(self) -> None:
        if self.session() is not None:
            self.session().stop()

    def _stop(self) -> None:
        self._stop_current()
        self.emit(SessionChosen(None))

    def _doctor(self) -> None:
        self.doctor_out.value = doctor_html(self.session.require().doctor())

    # ---- display -------------------------------------------------------------------------------
    def sync(self, alive: bool, busy: bool) -> None:
        """Which controls make sense now; the status lines."""
        self.start.disabled = self.attach.disabled = alive or busy
        self.device.disabled = self.ranks.disabled = alive or busy
        self.stop.disabled = self.doctor.disabled = not alive or busy
        s = self.session()
        if alive:
            if s.device in self.device.options:
                self.device.value = s.device
            self.ranks.value = s.world_size
        self.show_status()

    def show_status(self) -> None:
        self.status.value = self.status_html()

    def status_html(self) -> str:
        s = self.session()
        if not self.session.alive:
            return note("no session: choose ranks and device, then Start (or Attach to a running cluster)")
        state = self.activity() or "idle"
        rows = [(f"rank {place.rank}", place.host, place.pid,
                 s.device + (f":{place.gpu}" if s.device == "cuda" else ""), state)
                for place in s.ranks_info]
        return table(("rank", "host", "pid", "device", "state"), rows)
