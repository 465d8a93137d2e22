"""Every notebook starts with the Colab setup cell, and every lecture and solution
notebook reproduces its committed outputs under `pytest --nbval` (strict mode).

Each notebook runs in its own `pytest --nbval` subprocess (a fresh kernel of this Python
environment, cwd = the notebook's folder), so plain `pytest` needs no notebook options and
`pytest --nbval-lax exercises/X.ipynb` stays the learner's command."""
from __future__ import annotations

import os
import sys

import nbformat
import pytest

from conftest import ROOT, nbval_strict, notebooks_in
from colab_cell import COLAB_CELL

sys.path.insert(0, os.path.join(ROOT, "book", "_ext"))
import notebook_checks  # noqa: E402


@pytest.mark.parametrize("path", notebooks_in("notebooks") + notebooks_in("solutions") + notebooks_in("exercises"))
def test_first_cell_is_the_colab_setup_cell(path):
    nb = nbformat.read(os.path.join(ROOT, path), as_version=4)
    assert nb.cells, f"{path} is empty"
    first = nb.cells[0]
    assert first.cell_type == "code" and first.source == COLAB_CELL, (
        f"{path}: the first cell must be exactly scripts/colab_cell.py's COLAB_CELL "
        f"(print it with: python scripts/colab_cell.py)")


@pytest.mark.parametrize("path", notebooks_in("notebooks") + notebooks_in("solutions"))
def test_committed_outputs_are_one_complete_run(path):
    """nbval compares only cells that have an execution count, so a notebook committed
    unexecuted (or half-executed) would pass it: check the run is complete and error-free."""
    nb = nbformat.read(os.path.join(ROOT, path), as_version=4)
    problems = notebook_checks.problems(nb, require_executed=True)
    assert not problems, f"{path}: " + "; ".join(problems)


@pytest.mark.notebook_run("strict")
@pytest.mark.parametrize("path", notebooks_in("notebooks") + notebooks_in("solutions"))
def test_notebook_reproduces_its_outputs(path):
    result = nbval_strict(path)
    assert result.returncode == 0, (
        f"pytest --nbval {path} failed (exit {result.returncode}); if the change is intended, "
        f"re-execute it with python scripts/run_notebooks.py {path}:\n" + result.log[-8000:])
