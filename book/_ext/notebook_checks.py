"""Sphinx extension: a committed notebook that failed must fail the book build.

The book renders notebooks with their committed outputs (``execute_notebooks: off``
in _config.yml), so myst-nb never sees a cell fail. This extension reads every
notebook page before it is parsed and emits a warning (an error under ``-W``) for

Cells are numbered from 0, as nbval numbers them.

* an error output (a traceback) stored in a cell that is not tagged
  ``raises-exception`` and has no ``# NBVAL_RAISES_EXCEPTION`` line, and
* a notebook matching ``course_executed_notebooks`` (default ``notebooks/*``)
  whose code cells were not executed once, top to bottom: a non-empty code cell
  without an execution count, or counts that do not increase. That is what a run
  interrupted by a failing cell, or cells run by hand out of order, leaves behind.
"""
from __future__ import annotations

import fnmatch
import json
import os

from sphinx.util import logging

logger = logging.getLogger(__name__)
RAISES_TAG = "raises-exception"
RAISES_COMMENT = "# NBVAL_RAISES_EXCEPTION"


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _first_line(source: str) -> str:
    line = source.strip().splitlines()[0] if source.strip() else ""
    return line if len(line) <= 60 else line[:57] + "..."


def problems(nb: dict, require_executed: bool) -> list[str]:
    """Human-readable problems of one notebook (as parsed JSON); empty when it is fine."""
    found = []
    last_count, last_index = 0, None
    code_index = 0
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        code_index += 1
        source = _source(cell)
        allowed = RAISES_TAG in cell.get("metadata", {}).get("tags", []) or RAISES_COMMENT in source
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error" and not allowed:
                found.append(f"cell {index} ({_first_line(source)!r}) stored an error output ({out.get('ename')}: "
                             f"{str(out.get('evalue', ''))[:120]}); fix the cell and re-execute the "
                             f"notebook, or tag the cell '{RAISES_TAG}' if the error is the lesson")
        if not require_executed or not source.strip():
            continue
        count = cell.get("execution_count")
        if count is None:
            found.append(f"cell {index} ({_first_line(source)!r}) was never executed (no execution count): the committed "
                         f"outputs are not a complete run; re-execute the notebook with "
                         f"python scripts/run_notebooks.py")
            break
        if count <= last_count:
            found.append(f"cell {index} ({_first_line(source)!r}) has execution count {count} after cell {last_index}'s "
                         f"{last_count}: cells were not run once, top to bottom; re-execute the "
                         f"notebook with python scripts/run_notebooks.py")
            break
        last_count, last_index = count, index
    return found


def check_notebooks(app, env, docnames):
    patterns = app.config.course_executed_notebooks
    for docname in docnames:
        path = env.doc2path(docname)
        if not str(path).endswith(".ipynb"):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                nb = json.load(f)
        except (OSError, ValueError) as exc:
            logger.warning(f"cannot read notebook: {exc}", location=docname)
            continue
        rel = os.path.relpath(path, app.srcdir).replace(os.sep, "/")
        require = any(fnmatch.fnmatch(rel, p) for p in patterns)
        for problem in problems(nb, require):
            logger.warning(problem, location=docname, type="course", subtype="notebook")


def setup(app):
    app.add_config_value("course_executed_notebooks", ["notebooks/*"], "env")
    app.connect("env-before-read-docs", check_notebooks)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
