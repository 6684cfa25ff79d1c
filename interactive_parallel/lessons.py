"""The workshops' checks: `expect(condition, claim)` under every "Look for" of a notebook.

Owns one thing: turning a sentence a notebook tells the student into a check that either prints
what was verified ("checked: ...") or stops the notebook with that sentence as the error, so the
notebook tier of the tests fails naming the notebook and the claim that no longer holds
(tests/test_notebooks.py reads `ClaimFailed` from the executed cell). It knows nothing of ranks,
records or figures: the notebook computes the condition from the records its figure drew.
"""
from __future__ import annotations

__all__ = ["ClaimFailed", "expect"]


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
