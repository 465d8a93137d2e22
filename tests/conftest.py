"""Shared paths and helpers for the tests of the book, the notebooks and the exercises."""
from __future__ import annotations

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
if SCRIPTS not in sys.path:  # generate_exercises, grade, colab_cell are plain scripts
    sys.path.insert(0, SCRIPTS)


def notebooks_in(folder: str) -> list[str]:
    """Repository-relative paths of the notebooks directly in ``folder`` (sorted)."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, folder, "*.ipynb")))
