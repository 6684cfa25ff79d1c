"""Every notebook under notebooks/ runs top to bottom headless, with no error output.

Notebooks are committed without outputs (checked here too, so they stay small in git).
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.notebook
NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_without_errors(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, tmp_path / path.name)  # executed copy, for a look when a test fails
    assert_no_errors(nb)


def assert_no_errors(nb) -> None:
    """No error output, and no traceback printed to stderr, in any cell of an executed notebook."""
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error" or (o.output_type == "stream" and o.name == "stderr" and "Traceback" in o.text)]
    assert not errors, "\n".join(f"{o.get('ename', '')}: {o.get('evalue', o.get('text', ''))}" for o in errors)
