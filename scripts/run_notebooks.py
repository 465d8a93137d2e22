"""Execute notebooks in place (outputs committed with them) and report their run times.

    python scripts/run_notebooks.py notebooks/01_collectives.ipynb [more.ipynb ...]
    python scripts/run_notebooks.py --all

Runs each notebook top to bottom in a fresh kernel from the repository root's
point of view (cwd = the notebook's folder, as Jupyter and nbval do), fails on
the first error, and writes the notebook back with its new outputs.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from colab_cell import COLAB_CELL  # noqa: E402

COLAB_SETUP_FIRST_LINE = COLAB_CELL.splitlines()[0]


def run(path: str, timeout: int = 600) -> float:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}})
    started = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - started
    # Stable metadata: no kernel-specific noise in the diff.
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    # The Colab setup cell stays first but is not shown in the rendered book (CONTRIBUTING.md).
    first = nb.cells[0] if nb.cells else None
    if first is not None and first.cell_type == "code" and first.source.startswith(COLAB_SETUP_FIRST_LINE):
        tags = first.metadata.setdefault("tags", [])
        if "remove-cell" not in tags:
            tags.append("remove-cell")
    nbformat.write(nb, path)
    return elapsed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*")
    parser.add_argument("--all", action="store_true", help="notebooks/*.ipynb and solutions/*.ipynb")
    args = parser.parse_args(argv)
    paths = args.paths
    if args.all:
        paths = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))) + \
            sorted(glob.glob(os.path.join(ROOT, "solutions", "*.ipynb")))
    if not paths:
        parser.error("give notebook paths or --all")
    for path in paths:
        elapsed = run(path)
        print(f"{elapsed:7.1f} s  {os.path.relpath(path, ROOT)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
