"""The workshops' checks and numbers: `expect(condition, claim)` under every "Look for" of a
notebook, and `say(text, **numbers)` for a sentence whose numbers come from the run.

Owns two things. Turning a sentence a notebook tells the student into a check that either prints
what was verified ("checked: ...") or stops the notebook with that sentence as the error, so the
notebook tier of the tests fails naming the notebook and the claim that no longer holds
(tests/test_notebooks.py reads `ClaimFailed` from the executed cell); the cells that check are
tagged `check` with their source collapsed, so a student reads the lesson's code and the
"checked:" lines, not the checking code. And rendering prose with the run's own figures (`say`,
sizes in MiB by `mib`), so the text cannot disagree with the outputs beside it. It knows nothing
of ranks, records or figures: the notebook computes the condition from the records its figure drew.
"""
from __future__ import annotations

__all__ = ["ClaimFailed", "expect", "mib", "say"]


class ClaimFailed(AssertionError):
    """A notebook's claim about its own outputs no longer holds; the message is the claim."""


def expect(condition: object, claim: str, *, seen: object = None) -> None:
    """Check `claim` (what the student should see) by `condition`; print 'checked: <claim>'.

    `seen` is what was measured (a number, a tuple, a short dict): printed beside the claim, and
    named in the error when the claim fails, so the student sees the figures behind the check.
    """
    shown = "" if seen is None else f"  ({seen})"
    if not condition:
        raise ClaimFailed(f"{claim}{shown}")
    print(f"checked: {claim}{shown}")


def say(text: str, **numbers: object) -> None:
    """Show `text` (Markdown) with each `{name}` filled from `numbers`: a lesson's sentence whose
    figures are this run's, not typed."""
    from IPython.display import Markdown, display

    display(Markdown(text.format(**numbers)))


def mib(n: float, digits: int = 2) -> str:
    """Bytes as the figures' axes show them: '1.06 MiB' (KiB under one MiB)."""
    if abs(n) < 2 ** 20:
        return f"{n / 2 ** 10:.{digits}f} KiB"
    return f"{n / 2 ** 20:.{digits}f} MiB"

