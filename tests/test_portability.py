"""Committed outputs must not depend on the CPU that executed the notebook.

Matmul and reduction kernels differ between CPUs (AVX-512 vs AVX2, Intel vs AMD, MKL's code
paths), and a training loss after many steps differs in its last digits between them. The rule
(CONTRIBUTING.md, "Portable outputs"): checked cells print only exact things, or claims through
a check with a stated tolerance; raw kernel-dependent numbers go to `# NBVAL_IGNORE_OUTPUT`
cells. The strict nbval runs of the notebooks that train or compare floats (``conftest.OTHER_KERNELS``,
the one list; README.md, book/how_to_run.md and CONTRIBUTING.md name the same chapters, checked
below; chapter 0's 200 training steps are the most sensitive output of the course) use ATen's
portable "default" kernels instead of this machine's own, as a learner's CPU would, so a checked cell that prints a
kernel-dependent number fails in CI, not on a learner's machine. The same run serves
tests/test_notebooks.py: no notebook is run twice.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from conftest import OTHER_KERNELS, nbval_strict


def capability_under(env: dict) -> str:
    """The kernels torch picks in a fresh process with ``env`` added to the environment."""
    return _capability_under(tuple(sorted(env.items())))


@functools.lru_cache(maxsize=None)
def _capability_under(env: tuple) -> str:
    # once per environment in the session: every OTHER_KERNELS notebook asks for the same two
    # (a fresh process importing torch: ~1 s of CPU, 24 of them before)
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **dict(env)}, capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.notebook_run("strict")
@pytest.mark.parametrize("path", sorted(OTHER_KERNELS))
def test_notebook_reproduces_its_outputs_on_other_cpu_kernels(path):
    env = OTHER_KERNELS[path]
    native, forced = capability_under({"ATEN_CPU_CAPABILITY": ""}), capability_under(env)
    assert forced.lower() == env["ATEN_CPU_CAPABILITY"].lower(), f"{env} gave {forced}"
    if forced == native:
        pytest.skip(f"this machine's own kernels are already {native!r}")
    result = nbval_strict(path)
    assert result.returncode == 0, (
        f"pytest --nbval {path} with {env} (this machine's own kernels: {native}) failed. If a cell "
        f"printing a kernel-dependent number differs (training losses, generated text, max |diff|), print "
        f"it in a '# NBVAL_IGNORE_OUTPUT' cell and check the claim with a stated tolerance "
        f"(CONTRIBUTING.md); other differences mean the notebook needs re-executing:\n" + result.log[-8000:])


def chapters_named(paths) -> str:
    """The chapters of notebooks ``paths`` as the docs write them: "chapters 0, 3-9, 9b, 9c, 11 and 12"
    (a run of three or more consecutive numbered chapters as a range)."""
    numbers = [os.path.basename(p).split("_")[0].lstrip("0") or "0" for p in sorted(paths)]
    parts, run = [], []
    for n in numbers + [None]:
        if n is not None and n.isdigit() and (not run or int(n) == int(run[-1]) + 1):
            run.append(n)
            continue
        if run:
            parts += [f"{run[0]}-{run[-1]}"] if len(run) > 2 else run
        run = [n] if n is not None and n.isdigit() else []
        if n is not None and not n.isdigit():
            parts.append(n)
    return "chapters " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])


def test_chapters_named_reads_like_the_docs():
    assert chapters_named(["notebooks/00_a.ipynb", "notebooks/03_b.ipynb", "notebooks/04_c.ipynb",
                           "notebooks/05_c.ipynb", "notebooks/09b_d.ipynb", "notebooks/11_e.ipynb",
                           "notebooks/12_f.ipynb"]) == "chapters 0, 3-5, 9b, 11 and 12"
    assert chapters_named(["notebooks/05_a.ipynb"]) == "chapters 5"


@pytest.mark.parametrize("doc", ["README.md", "book/how_to_run.md", "CONTRIBUTING.md"])
def test_the_docs_name_the_notebooks_run_on_other_kernels(doc):
    """One list (conftest.OTHER_KERNELS); each document that names it states the same chapters."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    phrase = chapters_named(OTHER_KERNELS)
    assert phrase in text and "OTHER_KERNELS" in text, (
        f"{doc} must name the notebooks the suite runs with other CPU kernels as {phrase!r} and point to "
        f"OTHER_KERNELS in tests/conftest.py (the one list)")


# ----------------------------------------------------------------------------- Colab: the package alone

from check_colab_install import files_outside_package, notebooks_outside_package  # noqa: E402
from conftest import ROOT, notebooks_in  # noqa: E402


def test_every_notebook_needs_only_the_package():
    """Colab opens a notebook alone, with only course_lib installed: no notebook may load a file
    of the repository (chapter 5 once loaded ../benchmarks/tensor_parallel.py)."""
    outside = notebooks_outside_package(ROOT)
    assert not outside, "move what these cells need into course_lib:\n" + "\n".join(
        f"  {nb}: {p}" for nb, problems in outside.items() for p in problems)


def test_the_package_check_finds_repository_files(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    (tmp_path / "data.csv").write_text("1,2\n")
    for source in ('spec = importlib.util.spec_from_file_location("b", os.path.join("..", "benchmarks", "b.py"))',
                   "import sys\nsys.path.insert(0, '..')", "from benchmarks.tensor_parallel import main",
                   "%run ../scripts/grade.py", "rows = open('data.csv').read()",
                   "print('benchmarks/nd_parallel.py measures it')",
                   "print(f\"bytes {start}.. of {f}\")", "os.chdir(f'{root}/..')"):
        nb.cells.append(nbformat.v4.new_code_cell(source))
    nbformat.write(nb, tmp_path / "nb.ipynb")
    found = files_outside_package(str(tmp_path / "nb.ipynb"))
    # not cell 5 (prose) nor 6 (an f-string's ".." after a field is text); cell 7 changes folder
    assert {int(p.split(":")[0].split()[1]) for p in found} == {0, 1, 2, 3, 4, 7}, found


# ----------------------------------------------------------------------------- the book's text column

# At 1280 px the book's output box holds about 77 monospace characters: a wider output line wraps
# there (book/_static/course.css) but reads badly, and a wider code line hides behind a scrollbar.
# Printed lines: at most OUTPUT_WIDTH (course_lib.notebook.print_wrapped wraps at it); code lines
# shown in the book: at most CODE_WIDTH. Allowed for now (an entry: a notebook, or a folder): the
# solutions, never published, are being reworked; notebooks others are narrowing. Remove a notebook
# once it passes (test_wide_allow_lists_are_current says when), a folder entry by hand.
OUTPUT_WIDTH = 76
CODE_WIDTH = 80
STILL_WIDE = {"solutions/"}
# Every notebook's code fits: lectures, solutions and the exercises generated from them.
CODE_STILL_WIDE: set[str] = set()
RICHER = {"image/png", "image/jpeg", "image/svg+xml", "text/html", "text/markdown", "text/latex"}
HIDDEN = {"remove-cell", "remove-input"}   # cells whose code the book does not show (the Colab setup cell)
ALL_NOTEBOOKS = notebooks_in("notebooks") + notebooks_in("exercises") + notebooks_in("solutions")


def _code_cells(path: str):
    import nbformat

    nb = nbformat.read(os.path.join(ROOT, path), as_version=4)
    return [(index, cell) for index, cell in enumerate(nb.cells) if cell.cell_type == "code"]


def _printing_line(source: str) -> str:
    """The cell's first line that prints, for the message (where to look)."""
    return next((line.strip() for line in source.splitlines()
                 if any(word in line for word in ("print", "display(", "describe("))), "(the cell's last value)")


def wide_output_lines(path: str, width: int = OUTPUT_WIDTH) -> list[str]:
    """The committed output lines of ``path`` the book would show wider than ``width``: stream
    text, and text/plain where the output has nothing richer (a widget's note counts), each with
    its cell and the cell's first printing line."""
    wide = []
    for index, cell in _code_cells(path):
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                text = out.text
            elif "data" in out and "text/plain" in out.data and not RICHER & set(out.data):
                text = out.data["text/plain"]
            else:
                continue
            wide += [f"{path}:cell {index} ({len(line)} chars): {line[:60]}...   [{_printing_line(cell.source)[:70]}]"
                     for line in text.splitlines() if len(line) > width]
    return wide


def wide_code_lines(path: str, width: int = CODE_WIDTH) -> list[str]:
    """The code lines of ``path`` the book shows wider than ``width`` (hidden cells left out)."""
    return [f"{path}:cell {index} ({len(line)} chars): {line[:70]}..." for index, cell in _code_cells(path)
            if not HIDDEN & set(cell.metadata.get("tags", [])) for line in cell.source.splitlines()
            if len(line) > width]


def allowed(path: str, entries: set) -> bool:
    return path in entries or any(path.startswith(entry) for entry in entries if entry.endswith("/"))


@pytest.mark.parametrize("path", [p for p in ALL_NOTEBOOKS if not allowed(p, STILL_WIDE)])
def test_outputs_fit_the_book_column(path):
    wide = wide_output_lines(path)
    assert not wide, (f"{path}: {len(wide)} output lines wider than {OUTPUT_WIDTH} characters (print a table "
                      f"that fits, or course_lib.notebook.print_wrapped):\n  " + "\n  ".join(wide[:40]))


@pytest.mark.parametrize("path", [p for p in ALL_NOTEBOOKS if not allowed(p, CODE_STILL_WIDE)])
def test_code_fits_the_book_column(path):
    wide = wide_code_lines(path)
    assert not wide, (f"{path}: {len(wide)} code lines wider than {CODE_WIDTH} characters (they scroll sideways "
                      f"in the book): break them\n  " + "\n  ".join(wide[:40]))


def test_wide_allow_lists_are_current():
    from course_lib.notebook import BOOK_WIDTH

    assert BOOK_WIDTH == OUTPUT_WIDTH, "print_wrapped must wrap at the width this test allows"
    for entries, wide in ((STILL_WIDE, wide_output_lines), (CODE_STILL_WIDE, wide_code_lines)):
        notebooks = {entry for entry in entries if not entry.endswith("/")}
        assert notebooks <= set(ALL_NOTEBOOKS), f"no such notebook: {sorted(notebooks - set(ALL_NOTEBOOKS))}"
        narrow = sorted(p for p in notebooks if not wide(p))
        assert not narrow, f"these notebooks fit the column now: remove them from the allow list: {narrow}"


def test_print_wrapped_fits_the_column_and_keeps_short_lines():
    from course_lib.notebook import BOOK_WIDTH, wrap_lines
    from course_lib.widgets import fallback_note

    table = "rank  tokens/s\n   1  7.2e+04"
    assert wrap_lines(table) == table                                    # what fits is left alone
    long = "   " + " ".join(f"word{i}" for i in range(60))
    wrapped = wrap_lines(long).splitlines()
    assert all(len(line) <= BOOK_WIDTH for line in wrapped) and len(wrapped) > 1
    assert all(line.startswith("     ") for line in wrapped[1:])         # own indent + 2
    assert " ".join(" ".join(wrapped).split()) == " ".join(long.split())  # nothing lost
    note = fallback_note([f"control_{i}" for i in range(12)])
    assert all(len(line) <= BOOK_WIDTH for line in note.splitlines())
