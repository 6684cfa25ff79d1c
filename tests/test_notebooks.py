"""Every notebook under notebooks/ runs top to bottom headless, with no error output, and every
claim it checks with `interactive_parallel.lessons.expect` holds: a claim that no longer holds
fails the test with the notebook's name and the claim's own words.

Each notebook's closing prompts ("Questions to try", "**Try:**") run too, on the notebook's own
session, with a check of what each says happens: tests/notebook_questions.py splices in the cells of
its sidecar (tests/questions/<notebook>.py) before it runs.

Notebooks are committed without outputs (checked here too, so they stay small in git).

The tour (00) is executed once, by tests/test_binder.py in the environment Binder builds, with
every check of this module (run_notebook): a second run here would repeat the same cells on the
same package for a minute.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from notebook_questions import inject, sidecar

pytestmark = pytest.mark.notebook
NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
TOUR = "00_tour"
"""Run by tests/test_binder.py, in Binder's environment."""
HERE = [p for p in NOTEBOOKS if p.stem != TOUR]


@pytest.mark.parametrize("path", HERE, ids=[p.stem for p in HERE])
def test_notebook_runs_without_errors(path, tmp_path):
    run_notebook(path, tmp_path)


def run_notebook(path: Path, tmp_path: Path, kernel: str = "python3") -> None:
    """Execute `path` headless in `kernel`, its sidecar's prompts spliced in: committed without
    outputs, no error output, every expect() claim holds (a failed one names the notebook and the claim), at least one checked.
    The executed copy lands in `tmp_path`."""
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    if sidecar(path).exists():
        inject(nb, sidecar(path))        # its closing prompts, run on its own session (notebook_questions.py)
    client = NotebookClient(nb, timeout=600, kernel_name=kernel, resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as e:
        if e.ename == "ClaimFailed":
            pytest.fail(f"{path.name}: no longer true: {e.evalue}", pytrace=False)
        raise
    finally:
        nbformat.write(nb, tmp_path / path.name)  # executed copy, for a look when a test fails
    assert_no_errors(nb)
    assert checked_claims(nb) or path.stem in UNCHECKED, f"{path.name} checks none of its claims with expect()"


# Notebooks whose lesson is a procedure rather than an output (none yet).
UNCHECKED: set[str] = set()


def checked_claims(nb) -> list[str]:
    """The 'checked: ...' lines `expect` printed in an executed notebook."""
    return [line for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "stream" and o.name == "stdout"
            for line in o.text.splitlines() if line.startswith("checked: ")]


def assert_no_errors(nb) -> None:
    """No error output, and no traceback printed to stderr, in any cell of an executed notebook."""
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error" or (o.output_type == "stream" and o.name == "stderr" and "Traceback" in o.text)]
    assert not errors, "\n".join(f"{o.get('ename', '')}: {o.get('evalue', o.get('text', ''))}" for o in errors)


def test_a_failed_claim_names_the_notebook_and_the_claim(tmp_path):
    """A notebook whose expect() no longer holds fails with its name and the claim's words."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("from interactive_parallel.lessons import expect\n"
                                  "expect(2 + 2 == 4, 'two and two make four')"),
        nbformat.v4.new_code_cell("expect(len({1, 2}) == 1, 'every rank holds the same bytes', seen={1, 2})")])
    path = tmp_path / "claims.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(pytest.fail.Exception) as e:
        run_notebook(path, tmp_path)
    assert str(e.value) == "claims.ipynb: no longer true: every rank holds the same bytes  ({1, 2})"
    executed = nbformat.read(path, as_version=4)  # the test writes the executed copy over it
    assert checked_claims(executed) == ["checked: two and two make four"]
