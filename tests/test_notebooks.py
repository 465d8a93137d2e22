"""Every notebook starts with the Colab setup cell, and every lecture and solution
notebook reproduces its committed outputs under `pytest --nbval` (strict mode).

Each notebook runs in its own `pytest --nbval` subprocess (a fresh kernel of this Python
environment, cwd = the notebook's folder), so plain `pytest` needs no notebook options and
`pytest --nbval-lax exercises/X.ipynb` stays the learner's command."""
from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest

from conftest import ROOT, notebooks_in
from colab_cell import COLAB_CELL

SANITIZE = os.path.join(ROOT, "tests", "nbval_sanitize.cfg")
CELL_TIMEOUT = 300      # seconds per cell: a cell may start several multi-process launches
NOTEBOOK_TIMEOUT = 900  # seconds per notebook, so a hang cannot stall the suite


def run_nbval(path: str, *options: str, timeout: int = NOTEBOOK_TIMEOUT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--nbval-current-env", f"--nbval-cell-timeout={CELL_TIMEOUT}", *options, path]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("path", notebooks_in("notebooks") + notebooks_in("solutions") + notebooks_in("exercises"))
def test_first_cell_is_the_colab_setup_cell(path):
    nb = nbformat.read(os.path.join(ROOT, path), as_version=4)
    assert nb.cells, f"{path} is empty"
    first = nb.cells[0]
    assert first.cell_type == "code" and first.source == COLAB_CELL, (
        f"{path}: the first cell must be exactly scripts/colab_cell.py's COLAB_CELL "
        f"(print it with: python scripts/colab_cell.py)")


@pytest.mark.parametrize("path", notebooks_in("notebooks") + notebooks_in("solutions"))
def test_notebook_reproduces_its_outputs(path):
    result = run_nbval(path, "--nbval", f"--nbval-sanitize-with={SANITIZE}")
    assert result.returncode == 0, (
        f"pytest --nbval {path} failed (exit {result.returncode}); re-execute it with "
        f"python scripts/run_notebooks.py {path} if the change is intended:\n"
        + (result.stdout + result.stderr)[-8000:])
