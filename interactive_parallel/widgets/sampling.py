"""The prompts and sampling controls that Generate and Serve share.

Owns one group of controls (the prompts, one per line; sample or greedy; temperature; top-k),
built once by the panel and handed to both sections that read it: the Run section shows it
beside Generate, the Serve section makes its requests from it. Temperature and top-k are live
only while sampling is on. Knows nothing of sessions or of what the values are used for.
"""
from __future__ import annotations

from typing import Any

import ipywidgets as W

from ._common import Actions, css

DEFAULT_PROMPT = "12+35="


def number(widget: type, value: Any, description: str, cls: str, width: str) -> W.ValueWidget:
    """A numeric control with its label beside it (CSS class `cls`)."""
    return css(widget(value=value, description=description, style={"description_width": "initial"},
                      layout=W.Layout(width=width)), cls)


class Sampling:
    """Prompts, sample / greedy, temperature and top-k."""

    def __init__(self, actions: Actions):
        self.prompts = css(W.Textarea(value=DEFAULT_PROMPT, placeholder="one prompt per line",
                                      layout=W.Layout(width="100%", height="52px")), "ip-prompts")
        self.do_sample = css(W.Checkbox(value=False, description="sample", indent=False,
                                        layout=W.Layout(width="auto")), "ip-do-sample")
        self.temperature = number(W.FloatText, 1.0, "temperature", "ip-temperature", "140px")
        self.top_k = number(W.IntText, 0, "top-k", "ip-top-k", "100px")
        self._state = (False, False)
        actions.register(self.prompts, self.do_sample, self.temperature, self.top_k)
        self.do_sample.observe(lambda _c: self.sync(*self._state), names="value")

    def lines(self) -> list[str]:
        """The prompts typed, one per non-blank line."""
        return [line for line in self.prompts.value.splitlines() if line.strip()]

    def generate_options(self) -> dict[str, Any]:
        """The keywords `session.generate` takes for them."""
        return dict(do_sample=self.do_sample.value, temperature=float(self.temperature.value), top_k=self.top_k.value)

    def request_options(self) -> dict[str, Any]:
        """The keywords `plan.inference.staggered_requests` takes (temperature and top-k only when sampling)."""
        if not self.do_sample.value:
            return dict(do_sample=False)
        return dict(do_sample=True, temperature=float(self.temperature.value), top_k=self.top_k.value)

    def sync(self, alive: bool, busy: bool) -> None:
        self._state = alive, busy
        self.prompts.disabled = self.do_sample.disabled = not alive or busy
        self.temperature.disabled = self.top_k.disabled = not alive or busy or not self.do_sample.value
