"""The notebooks read as lessons: the cells that check a claim (`lessons.expect`) hold only checks,
are tagged `check` and open collapsed (JupyterLab hides their source, their "checked: ..." lines
show), so a student reads the lesson's code, not the checking code; and `lessons.say` renders a
sentence with the run's own numbers. The notebook tier (tests/test_notebooks.py) runs the checks."""
from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

from interactive_parallel.lessons import mib, say

pytestmark = pytest.mark.pure
NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
SHOWN = ("expect", "print", "say")
"""The calls a check cell may make for their effect: the check, and what it prints beside it."""


def only_checks(source: str) -> bool:
    """Every statement that is evaluated for its effect is a check or prints one: no figure, no
    call to the ranks the lesson relies on (assignments that compute what is checked are fine)."""
    for statement in ast.parse(source).body:
        if isinstance(statement, ast.Expr):
            func = statement.value.func if isinstance(statement.value, ast.Call) else None
            if not (isinstance(func, ast.Name) and func.id in SHOWN):
                return False
    return True


def code_cells(path: Path) -> list:
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_checks_sit_in_collapsed_cells_of_their_own(path):
    checking = [c for c in code_cells(path) if "expect(" in c.source and "def expect" not in c.source]
    assert checking, f"{path.name} checks no claim"
    for c in checking:
        assert only_checks(c.source), f"{path.name} cell {c.get('id')}: lesson code and checks in one cell: split it"
        assert c.metadata.get("tags") == ["check"] and c.metadata.get("jupyter", {}).get("source_hidden") is True, \
            f"{path.name} cell {c.get('id')}: a check cell opens collapsed and is tagged 'check'"
    lesson = [c for c in code_cells(path) if "check" not in c.metadata.get("tags", [])]
    assert all("expect(" not in c.source or "def expect" in c.source for c in lesson)


def test_say_renders_the_runs_numbers_as_markdown(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    say("parameters **{p}**, {n:.2f} M numbers", p=mib(1_116_416), n=0.279104)
    assert [m.data for m in shown] == ["parameters **1.06 MiB**, 0.28 M numbers"]
    assert mib(65_796) == "64.25 KiB" and mib(3 * 2**20, digits=1) == "3.0 MiB"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_prompt_with_code_runs_in_the_notebooks_sidecar(path):
    """Each code span of a notebook's closing prompts ("Questions to try", "**Try:**") appears, as the
    notebook prints it, in the code of its sidecar (tests/questions/), which the notebook tier runs on
    the notebook's session with a check of the stated effect: a prompt edited without its sidecar
    fails here, in seconds. A call the prompt gives in short (`Plan(dp=4, ep=2)`) may be run with more
    arguments after the ones it shows (`Plan(dp=4, ep=2, batch_size=8, ...)`)."""
    from notebook_questions import code_of, code_spans, prompt_text, sidecar

    spans = code_spans(prompt_text(nbformat.read(path, as_version=4)))
    if not spans:
        assert not sidecar(path).exists(), f"{sidecar(path).name}: {path.name} has no prompt with code"
        return
    assert sidecar(path).exists(), f"{path.name} has prompts with code and no {sidecar(path)}"
    code = code_of(sidecar(path))
    missing = [s for s in spans if s not in code and not (s.endswith(")") and s[:-1] + ", " in code)]
    assert not missing, f"{path.name}'s prompts not run as printed by {sidecar(path).name}: {missing}"


def test_the_prompts_are_read_from_questions_and_try_paragraphs_only():
    from notebook_questions import code_spans, prompt_text

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("## Look\nnot `this`\n\n**Try:** `s.train(steps=3,\n  seq_len=32)` then\n\nnor `that`"),
        nbformat.v4.new_markdown_cell("## Questions to try\n\n1. `a(1)`:\n```python\nwith x as t:\n    t.f()\n```\n## Clean up\n`s.stop()`")])
    assert code_spans(prompt_text(nb)) == ["s.train(steps=3, seq_len=32)", "a(1)", "with x as t: t.f()"]


def test_a_sidecars_cells_go_before_clean_up_or_before_the_cell_they_name(tmp_path):
    from notebook_questions import inject

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in ("s = 1", "## Zero", "s.stop()")])
    side = tmp_path / "side.py"
    side.write_text('"""doc"""\n# %%\na = 1\n# %%\nb = 2\n# %% before: ## Zero\nc = 3\n# %%\nd = 4\n')
    inject(nb, side)
    assert [c.source for c in nb.cells] == ["s = 1", "c = 3", "d = 4", "## Zero", "a = 1", "b = 2", "s.stop()"]
    assert [c.metadata.get("tags") for c in nb.cells].count(["question"]) == 4
