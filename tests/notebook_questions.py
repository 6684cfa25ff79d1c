"""Each notebook's closing prompts ("## Questions to try", a "**Try:**" paragraph) kept true: a
sidecar per notebook, tests/questions/<notebook>.py, holds every prompt's code as the notebook prints
it and a check (`lessons.expect`) of the effect the prompt or the lesson states.

Owns reading the prompts out of a notebook (the code spans a student would type), reading a sidecar
(its cells, and where they go), and splicing the sidecar's cells into a notebook before it runs, so
the prompts run on the notebook's own session and ranks (no pool of their own) and a failed claim
names the notebook and the claim as any other check does (tests/test_notebooks.py). It does not
run anything, and it knows no notebook's lesson: the sidecars do.

Sidecars live under tests/, not notebooks/, so that a student's file browser and a student's run
never see them; only the notebook tier runs them.

A sidecar is Python in cells, each opened by a line `# %%` (as editors read a percent-format
script); the text before the first cell is its docstring. Its cells go in just before the
notebook's closing cell that stops the session (its "Clean up"), or at the end of a notebook
without one. A cell opened by `# %% before: <text>` goes, with the cells after it up to the next
such line, before the first cell of the notebook whose source contains <text> instead: a prompt
that needs what an earlier section had (its session, a file the notebook deletes later). So the
cells for the default place come first in a sidecar.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

QUESTIONS = Path(__file__).parent / "questions"
CELL = re.compile(r"^# %%(?: before: (.+))?\n", re.M)
SPAN = re.compile(r"```[a-z]*\n(.*?)```|`([^`]+)`", re.S)


def sidecar(notebook: Path) -> Path:
    return QUESTIONS / f"{notebook.stem}.py"


def prompt_text(nb) -> str:
    """The markdown of a notebook's closing prompts: its "## Questions to try" section (to the next
    heading) and every paragraph that opens with "**Try:**"."""
    parts = []
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        questions = re.search(r"^## Questions to try\n(.*?)(?=^#|\Z)", cell.source, re.M | re.S)
        if questions:
            parts.append(questions.group(1))
        parts += re.findall(r"^\*\*Try:\*\*(.*?)(?=\n\n|\Z)", cell.source, re.M | re.S)
    return "\n".join(parts)


def code_spans(markdown: str) -> list[str]:
    """Every inline code span and fenced block, whitespace folded (a span may wrap a line)."""
    return [fold(block or inline) for block, inline in SPAN.findall(markdown)]


def fold(text: str) -> str:
    return " ".join(text.split())


def cells(path: Path) -> list[tuple[str | None, str]]:
    """(the text of the notebook cell it goes before, None for the default place; its source), in order."""
    parts = CELL.split(path.read_text())[1:]             # docstring, then (marker, source) pairs
    out, before = [], None
    for marker, source in zip(parts[::2], parts[1::2]):
        before = marker.strip() if marker else before    # a cell without a marker follows the one before it
        if source.strip():
            out.append((before, source.strip()))
    return out


def code_of(path: Path) -> str:
    """The sidecar's code, comments left out, whitespace folded: where every prompt's spans must appear."""
    return fold("\n".join(line for _, c in cells(path) for line in c.splitlines() if not line.lstrip().startswith("#")))


def inject(nb, path: Path) -> None:
    """Splice the sidecar's cells into `nb` (in place) where the sidecar says (module docstring)."""
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    default = code[-1] if code and ".stop()" in nb.cells[code[-1]].source else len(nb.cells)
    placed = []
    for before, source in cells(path):
        at = default
        if before is not None:
            at = next((i for i, c in enumerate(nb.cells) if before in c.source), None)
            assert at is not None, f"{path.name}: no cell of its notebook contains {before!r}"
        placed.append((at, nbformat.v4.new_code_cell(source, metadata={"tags": ["question"]})))
    for at, cell in sorted(reversed(placed), key=lambda p: p[0], reverse=True):   # last first: indices hold
        nb.cells.insert(at, cell)
