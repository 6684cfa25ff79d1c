"""What every panel section shares: CSS classes, in-place figure refresh, the action runner, the session.

Owns the callback discipline of DESIGN.md (disable the controls, run inside the error Output,
show the remote traceback naming the rank, re-enable in `finally`), the one helper that copies a
freshly drawn plotly Figure into a live FigureWidget, and `SessionRef`, the way a section reads
the session the panel drives now. Knows nothing of what any button does, nor of torch or plans;
long calls are widgets/jobs.py's.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, Iterable

import ipywidgets as W
import plotly.graph_objects as go

from ..cluster.errors import RankError, RankTimeout, SessionError


def css(widget: W.DOMWidget, *classes: str) -> W.DOMWidget:
    """`widget` with CSS classes added (the browser test selects controls by them)."""
    for c in classes:
        widget.add_class(c)
    return widget


def button(description: str, cls: str, *, style: str = "", tooltip: str = "") -> W.Button:
    return css(W.Button(description=description, button_style=style, tooltip=tooltip or description,
                        layout=W.Layout(width="auto", min_width="64px")), cls)


def row(*widgets: W.Widget) -> W.HBox:
    """Widgets side by side, wrapping onto the next line when the column is narrow."""
    return W.HBox(list(widgets), layout=W.Layout(flex_flow="row wrap", align_items="center", grid_gap="4px"))


def figure_widget(figure: go.Figure, cls: str, height: int = 360) -> go.FigureWidget:
    widget = go.FigureWidget(figure)
    widget.update_layout(height=height, margin=dict(l=50, r=20, b=40))  # the top one is the title's (viz)
    return css(widget, "ip-figure", cls)


# ---- in-place figure refresh ------------------------------------------------------------------
def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaves; lists and the template are leaves (assigned whole)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key != "template":
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _shape(trace_json: dict) -> set[str]:
    return set(_flatten({k: v for k, v in trace_json.items() if k != "uid"}))


def refresh(widget: go.FigureWidget, figure: go.Figure, *,
            keep: Iterable[str] = ("height", "width", "margin.l", "margin.r", "margin.b")) -> None:
    """Make the live `widget` show `figure` without rebuilding it.

    Traces of the same count, types and properties are updated in place (one batched message:
    the loss curve grows without flicker); otherwise they are replaced. The layout is diffed
    leaf by leaf and stale leaves are set to None, because the browser side merges a relayout
    into what it has: without the reset an empty-state note or hidden ticks would linger.
    `keep` names layout keys (or dotted paths) the panel owns (its size, the side margins), left
    as they are; the top margin follows the figure, whose title it holds.
    """
    old_traces = [t.to_plotly_json() for t in widget.data]
    new_traces = [t.to_plotly_json() for t in figure.data]
    in_place = len(old_traces) == len(new_traces) and all(
        _shape(a) == _shape(b) for a, b in zip(old_traces, new_traces))
    if not in_place:
        widget.data = ()
        if figure.data:
            widget.add_traces(list(figure.data))
    old_json, new_json = widget.layout.to_plotly_json(), figure.layout.to_plotly_json()
    old, new = _flatten(old_json), _flatten(new_json)
    owned = tuple(keep)
    # Subplot axes the widget lacks (xaxis2, ...) are set whole: a dotted path into one does not exist yet.
    fresh = {top for top in new_json if top not in old_json and top not in owned}
    skip = lambda path: path.split(".")[0] in fresh or any(  # noqa: E731
        path == k or path.startswith(k + ".") for k in owned)
    with widget.batch_update():
        if in_place:
            for trace, fresh_trace in zip(widget.data, new_traces):
                trace.update({k: v for k, v in fresh_trace.items() if k not in ("type", "uid")}, overwrite=True)
        for path in old:
            if path not in new and not skip(path):
                widget.layout[path] = None
        for top in fresh:
            widget.layout[top] = new_json[top]
        for path, value in new.items():
            if not skip(path) and old.get(path) != value:
                widget.layout[path] = value


# ---- the session ----------------------------------------------------------------------------------
class SessionRef:
    """The session the panel drives now, read through the panel's getter each time (the Cluster
    section may start, attach to or stop one at any moment)."""

    def __init__(self, get: Callable[[], Any]):
        self._get = get

    def __call__(self) -> Any:
        return self._get()

    @property
    def alive(self) -> bool:
        s = self._get()
        return s is not None and s.alive

    def require(self) -> Any:
        if not self.alive:
            raise SessionError("no session: start one in the Cluster section (Start or Attach)")
        return self._get()


# ---- errors -----------------------------------------------------------------------------------
def describe_error(exc: BaseException, what: str = "") -> str:
    """Text for the panel's error area: a rank's failure names the rank and carries its traceback;
    a refusal (bad plan, bad input) is its message alone; anything else adds the local traceback."""
    head = f"{what} failed: " if what else ""
    if isinstance(exc, RankError):
        return f"{head}rank {exc.rank}" + (f" ({exc.host})" if exc.host else "") + f" raised {exc.ename}\n{exc}"
    if isinstance(exc, (RankTimeout, SessionError, ValueError, KeyError, OSError)):
        return f"{head}{type(exc).__name__}: {exc}"
    return f"{head}{''.join(traceback.format_exception(exc))}"


class Actions:
    """Runs the panel's callbacks: disables every action control while one runs (the kernel is
    busy, queued clicks would pile up), captures output in the error Output, shows failures
    there, and in `finally` hands the controls back to `sync`, which derives each one's
    enabled state from what is true now (a session may have started or stopped meanwhile)."""

    def __init__(self, errors: W.Output, sync: Callable[[], None] = lambda: None):
        self.errors = errors
        self.sync = sync
        self.controls: list[W.DOMWidget] = []

    def register(self, *controls: W.DOMWidget) -> None:
        self.controls.extend(controls)

    def show(self, text: str) -> None:
        # append_stdout works with or without a kernel (tests read .outputs) and from any thread.
        self.errors.append_stdout(text if text.endswith("\n") else text + "\n")

    def clear(self) -> None:
        self.errors.outputs = ()

    def freeze(self, keep: Iterable[W.DOMWidget] = ()) -> None:
        kept = set(map(id, keep))
        for c in self.controls:
            c.disabled = id(c) not in kept

    def run(self, what: str, fn: Callable[[], Any]) -> Any:
        """fn() with the controls frozen; its exception shown (never raised into the kernel)."""
        self.clear()
        self.freeze()
        try:
            with self.errors:
                try:
                    return fn()
                except Exception as exc:  # noqa: BLE001 - every failure belongs in the panel
                    self.show(describe_error(exc, what))
                    return None
        finally:
            self.sync()

    def on_click(self, btn: W.Button, what: str, fn: Callable[[], Any]) -> W.Button:
        self.register(btn)
        btn.on_click(lambda _b: self.run(what, fn))
        return btn
