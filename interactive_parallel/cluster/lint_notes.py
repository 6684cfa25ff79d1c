"""What the client says of the layout lint's findings: one merged list, and the warning at apply.

Owns `LayoutWarning` and `warn_layout` (ModelOps.apply and load_model call it with the
LayoutInfo every rank returned; each carries the findings runtime.layout.lint made on that rank
right after building its layout). Only the findings that make the numbers wrong are warned of:
those that cost traffic hold on valid plans the runtime chose (sequence parallelism's norm
gradients, runtime.layout.lint), and a note at every apply would teach users to skip them.
Knows nothing of how findings are made; never blocks an apply.
"""
from __future__ import annotations

import warnings
from typing import Sequence

from ..records import LayoutInfo, LintSeverity
from ..records.lint import merged


class LayoutWarning(UserWarning):
    """The layout lint found something in a layout just applied that will make the step's numbers
    wrong (Session.check_layout lists every finding); the layout is applied all the same."""


def warn_layout(infos: Sequence[LayoutInfo]) -> None:
    """Warn of the findings the ranks' lint made at apply that will make the numbers wrong."""
    wrong = [f for f in merged(f for info in infos for f in info.findings) if f.severity == LintSeverity.WRONG]
    if wrong:
        shown = "\n  ".join(map(str, wrong[:3])) + (f"\n  ... and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        warnings.warn(f"layout lint: {len(wrong)} finding(s) that will make the numbers differ from one "
                      f"process's (s.check_layout() lists them all):\n  {shown}", LayoutWarning, stacklevel=2)
