"""Generate exercises/ from solutions/ (the single source of truth).

    python scripts/generate_exercises.py            # (re)write exercises/*.ipynb
    python scripts/generate_exercises.py --check    # exit 1 if exercises/ is stale
    python scripts/generate_exercises.py solutions/02_collective_algorithms_exercises.ipynb  # just one

What a solution notebook turns into:

* In a code cell, every region between a ``### BEGIN SOLUTION`` line and a
  ``### END SOLUTION`` line becomes ``raise NotImplementedError("Exercise: ...")``
  at the indentation of the BEGIN line. The message is the text after the
  marker (``### BEGIN SOLUTION reduce-scatter, then all-gather``) or else
  ``implement <the enclosing function>``. A region must sit inside a function
  body, so the cell still runs and only calling the function raises.
* In a markdown cell, a region becomes ``*Your answer here.*``.
* A check cell (first line ``# NBVAL_CHECK_OUTPUT``) loses that line and its
  output: a learner never sees the pass line before passing. In a notebook a
  failed check raises (``course_lib.grading.GradeFailed``), so ``pytest
  --nbval-lax`` fails until it passes; ``scripts/grade.py`` knows the question by
  the cell's code and compares its output with the solution's stored pass line.
* A last cell is added that calls ``course_lib.grading.all_checks_passed`` with the names of
  the solution's questions (the first word of each stored pass line): it fails while a check
  cell was deleted, skipped or failing, so ``pytest --nbval-lax`` fails on a notebook whose
  check cell was deleted, as ``scripts/grade.py`` scores it 0.
* Other ``# NBVAL_*`` comment lines become the equivalent cell tags
  (``nbval-ignore-output``, ``nbval-skip``, ``raises-exception``): nbval still
  reads them, readers of the book do not see them.
* The Colab setup cell gets the tag ``remove-cell`` (the book starts at the title).
* Every output and execution count is cleared; cell ids, tags and the kernel
  spec are kept, so the output is byte-for-byte reproducible.

Exercise notebooks that no longer have a solution are deleted (``--check``
reports them).
"""
from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import re
import sys

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"
MARKDOWN_STUB = "*Your answer here.*"
# nbval's comment markers and the cell tags nbval reads in their place
MARKER_TAGS = {"# NBVAL_IGNORE_OUTPUT": "nbval-ignore-output", "# NBVAL_SKIP": "nbval-skip",
               "# NBVAL_RAISES_EXCEPTION": "raises-exception"}
_DEF = re.compile(r"^(\s*)(?:async\s+)?def\s+(\w+)\s*\(")


class SolutionFormatError(ValueError):
    """A solution notebook breaks the BEGIN/END SOLUTION conventions."""


def is_check_cell(cell) -> bool:
    return cell.cell_type == "code" and cell.source.lstrip().startswith(CHECK_MARKER)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _enclosing_function(lines, index, indent):
    """Name of the innermost ``def`` whose body holds ``lines[index]`` (indented ``indent``), or None."""
    block = len(indent)  # smallest indentation of the code between that def and the region
    for line in reversed(lines[:index]):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _DEF.match(line)
        if m and len(m.group(1)) < block:
            return m.group(2)
        block = min(block, len(_indent(line)))
    return None


def strip_code(source: str, where: str) -> str:
    """Replace each BEGIN/END SOLUTION region of a code cell by a NotImplementedError stub."""
    lines = source.split("\n")
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith(END):
            raise SolutionFormatError(f"{where}: '{END}' without a '{BEGIN}' (line {i + 1})")
        if not stripped.startswith(BEGIN):
            out.append(line)
            i += 1
            continue
        indent = _indent(line)
        hint = stripped[len(BEGIN):].strip(" :-")
        func = _enclosing_function(lines, i, indent)
        if func is None or not indent:
            raise SolutionFormatError(
                f"{where}: '{BEGIN}' (line {i + 1}) is not inside a function body; learner code "
                f"goes in a function so the cell still runs (see CONTRIBUTING.md)")
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(END):
            if lines[j].strip().startswith(BEGIN):
                raise SolutionFormatError(f"{where}: nested '{BEGIN}' (line {j + 1})")
            j += 1
        if j == len(lines):
            raise SolutionFormatError(f"{where}: '{BEGIN}' (line {i + 1}) has no '{END}'")
        if _indent(lines[j]) != indent:
            raise SolutionFormatError(f"{where}: '{END}' (line {j + 1}) is not indented like its '{BEGIN}'")
        message = "Exercise: " + (hint or f"implement {func}")
        out.append(f"{indent}raise NotImplementedError({json.dumps(message)})")
        i = j + 1
    return "\n".join(out)


def strip_markdown(source: str, where: str) -> str:
    """Replace each BEGIN/END SOLUTION region of a markdown cell (a written answer)."""
    pattern = re.compile(rf"^[ \t]*{re.escape(BEGIN)}.*?^[ \t]*{re.escape(END)}[^\n]*", re.S | re.M)
    result = pattern.sub(MARKDOWN_STUB, source)
    if BEGIN in result or END in result:
        raise SolutionFormatError(f"{where}: unmatched '{BEGIN}' / '{END}' in a markdown cell")
    return result


def _add_tag(cell, tag):
    tags = cell.metadata.setdefault("tags", [])
    if tag not in tags:
        tags.append(tag)


def markers_to_tags(cell) -> None:
    """Drop the cell's ``# NBVAL_*`` lines (readers see the source), keeping their effect as tags."""
    kept = []
    for line in cell.source.split("\n"):
        marker = line.strip()
        if marker == CHECK_MARKER:
            continue  # a check cell of an exercise is not compared: it raises when it fails
        if marker in MARKER_TAGS:
            _add_tag(cell, MARKER_TAGS[marker])
            continue
        kept.append(line)
    cell.source = "\n".join(kept)


def _is_setup_cell(cell) -> bool:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from colab_cell import COLAB_CELL
    finally:
        sys.path.pop(0)
    return cell.cell_type == "code" and cell.source.strip() == COLAB_CELL.strip()


def make_exercise(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The exercise notebook for one solution notebook (a new object; the input is untouched)."""
    nb = copy.deepcopy(solution)
    nb.metadata.pop("widgets", None)
    for index, cell in enumerate(nb.cells):
        where = f"{name}, cell {index}"
        cell.metadata.pop("execution", None)
        if cell.cell_type == "markdown":
            cell.source = strip_markdown(cell.source, where)
        elif cell.cell_type == "code":
            if is_check_cell(cell):
                if BEGIN in cell.source or END in cell.source:
                    raise SolutionFormatError(f"{where}: a check cell cannot hold a solution region")
                if not cell.outputs or cell.execution_count is None:
                    raise SolutionFormatError(
                        f"{where}: check cell has no stored output; execute the solution notebook "
                        f"(python scripts/run_notebooks.py solutions/...) so its pass line is stored")
            else:
                cell.source = strip_code(cell.source, where)
            if index == 0 and _is_setup_cell(cell):
                _add_tag(cell, "remove-cell")
            markers_to_tags(cell)
            cell.outputs = []
            cell.execution_count = None
    if question_names(solution):
        nb.cells.append(_session_cell(solution, nb))
    return nb


SESSION_CELL = """# Every question of this notebook, checked in this session: a check cell
# deleted, skipped or failing makes this cell fail (and `pytest --nbval-lax`)
from course_lib.grading import all_checks_passed

ok = all_checks_passed({names})"""


def question_names(solution) -> list:
    """The questions of a solution: the name before ':' in each check cell's stored line."""
    names = []
    for cell in solution.cells:
        if is_check_cell(cell):
            text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
            first = text.strip().splitlines()[0] if text.strip() else ""
            if ":" in first:
                names.append(first.split(":", 1)[0].strip())
    return names


def _session_cell(solution, nb):
    names = question_names(solution)
    listed = "[" + ", ".join(json.dumps(n) for n in names) + "]"
    if len(listed) > 60:   # one name a line: the notebook's lines stay within ~80 characters
        listed = "[\n    " + ",\n    ".join(json.dumps(n) for n in names) + ",\n]"
    cell = nbformat.v4.new_code_cell(SESSION_CELL.format(names=listed))
    cell.id = "all-checks-passed"   # a fixed id: the output is byte-for-byte reproducible
    return cell


def render(nb: nbformat.NotebookNode) -> str:
    """Notebook JSON exactly as nbformat.write stores it (with the final newline)."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def plan(solutions_dir: str, exercises_dir: str, only=()):
    """(path, wanted text or None for 'delete') for every file under exercises_dir
    (only the solutions named in ``only``, when given)."""
    wanted = {}
    for src in sorted(glob.glob(os.path.join(solutions_dir, "*.ipynb"))):
        name = os.path.basename(src)
        if only and name not in only:
            continue
        solution = nbformat.read(src, as_version=4)
        wanted[os.path.join(exercises_dir, name)] = render(make_exercise(solution, name=src))
    for stale in sorted(glob.glob(os.path.join(exercises_dir, "*.ipynb"))):
        if stale not in wanted and not only:
            wanted[stale] = None
    return wanted


def _read(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="only these solution notebooks (file names or paths)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if exercises/ differ from what would be generated")
    parser.add_argument("--solutions", default=os.path.join(ROOT, "solutions"), help="source folder")
    parser.add_argument("--exercises", default=os.path.join(ROOT, "exercises"), help="output folder")
    args = parser.parse_args(argv)
    try:
        wanted = plan(args.solutions, args.exercises, {os.path.basename(n) for n in args.names})
    except SolutionFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stale = []
    for path, text in wanted.items():
        current = _read(path)
        if current == text:
            continue
        rel = os.path.relpath(path, ROOT)
        stale.append(rel)
        if args.check:
            why = "has no solution notebook" if text is None else ("missing" if current is None else "differs")
            print(f"{rel}: {why}")
        elif text is None:
            os.remove(path)
            print(f"removed {rel}")
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
            print(f"wrote {rel}")
    if args.check:
        if stale:
            print("exercises/ is out of date: run python scripts/generate_exercises.py", file=sys.stderr)
            return 1
        print(f"exercises/ up to date ({sum(t is not None for t in wanted.values())} notebooks)")
    elif not stale:
        print(f"exercises/ already up to date ({len(wanted)} notebooks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
