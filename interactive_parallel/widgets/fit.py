"""Figures that fit their column: a small front-end helper (an anywidget with no visible part).

Owns one fact about plotly's FigureWidget (plotly 7, rendered through anywidget) and its cure.
Such a figure takes its size when first drawn, and its element is often not in the page yet
then, so it gets plotly's default 700 px; it never resizes afterwards (its window-resize hook
is not installed on this path), so a figure in a closed tab, a narrower column or a toggled
side bar stays too wide. The helper measures, in the browser, the width of every `.ip-figure`
element in its panel whenever one changes (ResizeObserver; a closed tab's figures measure 0 and
are left alone) and sends the widths here, where each figure's `layout.width` is set to its
element's. Knows nothing of what the figures show, nor of sessions.
"""
from __future__ import annotations

import anywidget
import plotly.graph_objects as go
import traitlets

ESM = """
function watch(root, model) {
  const observed = new WeakSet();
  let queued = false;
  const report = () => {
    queued = false;
    const widths = {};
    root.querySelectorAll('.ip-figure').forEach((figure) => {
      const name = [...figure.classList].find((c) => c.startsWith('ip-') && c.endsWith('-figure') && c !== 'ip-figure');
      const width = Math.floor(figure.getBoundingClientRect().width);
      if (name && width > 0) widths[name] = width;
    });
    const old = model.get('widths') || {};
    if (Object.keys(widths).some((k) => old[k] !== widths[k])) {
      model.set('widths', { ...old, ...widths });
      model.save_changes();
    }
  };
  const later = () => { if (!queued) { queued = true; requestAnimationFrame(report); } };
  const sizes = new ResizeObserver(later);
  const adopt = () => root.querySelectorAll('.ip-figure').forEach((figure) => {
    if (!observed.has(figure)) { observed.add(figure); sizes.observe(figure); }
  });
  const added = new MutationObserver(adopt);
  added.observe(root, { childList: true, subtree: true });
  adopt();
  return () => { sizes.disconnect(); added.disconnect(); };
}

export default {
  render({ model, el }) {
    let stop = null;
    let frame = 0;
    const start = () => {
      const root = el.closest('.ip-panel');
      if (root) { stop = watch(root, model); } else { frame = requestAnimationFrame(start); }
    };
    frame = requestAnimationFrame(start);
    return () => { cancelAnimationFrame(frame); if (stop) stop(); };
  },
};
"""


class FitFigures(anywidget.AnyWidget):
    """Put one inside a panel (an element with class `ip-panel`); it shows nothing and keeps each
    of `figures` (CSS class -> FigureWidget) as wide as its element."""

    _esm = ESM
    widths = traitlets.Dict().tag(sync=True)
    """Figure CSS class -> width of its element in the browser, in px."""

    def __init__(self, figures: dict[str, go.FigureWidget], **kwargs):
        super().__init__(**kwargs)
        self.figures = figures
        self.observe(lambda _c: self.fit(), names="widths")

    def fit(self) -> None:
        for name, width in self.widths.items():
            figure = self.figures.get(name)
            if figure is not None and width > 0 and figure.layout.width != width:
                figure.layout.width = width
