"""The JupyterLab control panel: a thin view over Session (ipywidgets + plotly FigureWidgets).

Owns nothing a script could not do: each control calls a public Session method or a pure
plan/ or viz/ function. Imported lazily (by `interactive_parallel.panel()`), so a kernel that
never shows the panel never loads ipywidgets or plotly.
"""
from .panel import Panel, panel

__all__ = ["Panel", "panel"]
