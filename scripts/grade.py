"""Grade exercise notebooks: a score table of questions passed per notebook.

    python scripts/grade.py                          # every notebook in exercises/
    python scripts/grade.py submissions/             # a folder of learners' notebooks (recursive)
    python scripts/grade.py alice/01_collectives_exercises.ipynb -v
    python scripts/grade.py submissions/ --csv grades.csv

A *question* is a check cell: a code cell whose first line is
``# NBVAL_CHECK_OUTPUT``. It calls a grader that prints one stable line
(``ring_all_reduce: 6/6 cases passed``). A question passes when the re-executed
cell prints exactly what the same cell of the solution printed, which is the
comparison ``pytest --nbval-lax`` makes for one notebook.

For an instructor the expected lines and the check cells' code come from the
reference notebook of the same name in ``solutions/`` (``--reference``), not
from the learner's file: an edited check cell or a pasted pass line scores
nothing. A check cell the learner deleted is run at the end of the notebook.
Without a reference notebook, the notebook's own stored check outputs are used.

Each notebook runs top to bottom in a fresh kernel of this Python environment,
in its own folder, continuing past errors; a cell has ``--timeout`` seconds.
The graders themselves never hang or raise on a learner's bug.

Exit status: 0 when every question of every notebook passed, 1 otherwise,
2 when there was nothing to grade.
"""
from __future__ import annotations

import argparse
import copy
import csv
import glob
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"
# What nbval leaves out of the comparison (plus images, which it skips without nbdime).
SKIP_MIME = {"image/png", "image/jpeg", "application/vnd.jupyter.widget-view+json"}


@dataclass
class Question:
    name: str
    passed: bool
    got: str  # first line the learner's run printed, or what went wrong


@dataclass
class NotebookGrade:
    path: str
    questions: list = field(default_factory=list)
    error: str = ""  # the notebook could not be run at all (bad JSON, dead kernel, ...)
    note: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> int:
        return sum(q.passed for q in self.questions)

    @property
    def total(self) -> int:
        return len(self.questions)


def is_check_cell(cell) -> bool:
    return cell.cell_type == "code" and cell.source.lstrip().startswith(CHECK_MARKER)


def comparable(outputs) -> dict:
    """Outputs flattened the way nbval compares them: key -> list of values, streams coalesced."""
    merged = []
    for out in outputs:
        if out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream" \
                and merged[-1].get("name") == out.get("name"):
            merged[-1] = dict(merged[-1], text=merged[-1]["text"] + out["text"])
        else:
            merged.append(dict(out))
    flat = defaultdict(list)
    for out in merged:
        kind = out.get("output_type")
        if kind == "stream":
            text = out["text"] if isinstance(out["text"], str) else "".join(out["text"])
            flat[out["name"]].append(text)
        elif kind in ("execute_result", "display_data"):
            for mime, value in out.get("data", {}).items():
                if mime not in SKIP_MIME:
                    flat[mime].append(value if isinstance(value, str) else str(value))
        elif kind == "error":
            flat["error"].append(f"{out.get('ename')}: {out.get('evalue')}")
    return dict(flat)


def question_name(expected_outputs, index: int) -> str:
    text = "".join(comparable(expected_outputs).get("stdout", []))
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first.split(":", 1)[0].strip() if ":" in first else f"question {index + 1}"


def _first_line(outputs) -> str:
    flat = comparable(outputs)
    if "error" in flat:
        return "error: " + flat["error"][0].splitlines()[0]
    text = "".join(flat.get("stdout", []) + flat.get("stderr", []) + flat.get("text/plain", []))
    lines = text.strip().splitlines()
    return lines[0] if lines else "(no output)"


def match_check_cells(reference, learner):
    """Pair each reference check cell with a learner cell index: by cell id, then source, then order."""
    ref_checks = [c for c in reference.cells if is_check_cell(c)]
    learner_checks = [i for i, c in enumerate(learner.cells) if is_check_cell(c)]
    by_id = {learner.cells[i].get("id"): i for i in learner_checks if learner.cells[i].get("id")}
    by_source = {learner.cells[i].source.strip(): i for i in learner_checks}
    used, pairs = set(), []
    for k, ref in enumerate(ref_checks):
        i = by_id.get(ref.get("id")) if ref.get("id") else None
        if i is None or i in used:
            i = by_source.get(ref.source.strip())
        if (i is None or i in used) and k < len(learner_checks) and learner_checks[k] not in used:
            i = learner_checks[k]
        if i is not None and i in used:
            i = None
        if i is not None:
            used.add(i)
        pairs.append((ref, i))
    return pairs


def prepare(learner, reference):
    """The notebook to run (check cells replaced by the reference's) and [(cell index, expected outputs)]."""
    nb = copy.deepcopy(learner)
    plan = []
    for ref, index in match_check_cells(reference, nb):
        if index is None:  # deleted by the learner: run it last
            nb.cells.append(nbformat.v4.new_code_cell(ref.source))
            index = len(nb.cells) - 1
        else:
            nb.cells[index].source = ref.source
        plan.append((index, ref.outputs))
    return nb, plan


def current_env_kernel_specs():
    """A kernel spec manager that starts ipykernel with this interpreter (like nbval --nbval-current-env)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    return CurrentEnv()


def execute(nb, cwd: str, timeout: int):
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    km = KernelManager(kernel_name="python3", kernel_spec_manager=current_env_kernel_specs())
    client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=True, interrupt_on_timeout=True,
                            record_timing=False, resources={"metadata": {"path": cwd}})
    # The kernel's own stderr (ipykernel start-up notices) is noise in a score table; what
    # the cells print reaches us through the kernel's messages, not through this stream.
    client.execute(stderr=subprocess.DEVNULL)


def grade_notebook(path: str, reference_dir: str | None = None, timeout: int = 300) -> NotebookGrade:
    started = time.perf_counter()
    grade = NotebookGrade(path)
    try:
        learner = nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - a broken file scores zero, the table goes on
        grade.error = f"cannot read notebook: {type(exc).__name__}: {exc}"
        return grade
    reference = learner
    ref_path = reference_for(path, reference_dir) if reference_dir else None
    if ref_path and os.path.abspath(ref_path) != os.path.abspath(path):
        reference = nbformat.read(ref_path, as_version=4)
    elif reference_dir and not ref_path:
        grade.note = "no reference notebook: expected lines taken from the notebook itself"
    nb, plan = prepare(learner, reference)
    if not plan:
        grade.error = "no check cells (# NBVAL_CHECK_OUTPUT) to grade"
    else:
        try:
            execute(nb, os.path.dirname(os.path.abspath(path)), timeout)
        except Exception as exc:  # noqa: BLE001 - dead kernel etc.: cells not run score zero
            grade.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        for k, (index, expected) in enumerate(plan):
            cell = nb.cells[index]
            got = cell.get("outputs", [])
            ok = bool(got) and comparable(got) == comparable(expected)
            grade.questions.append(Question(question_name(expected, k), ok, _first_line(got)))
    grade.seconds = time.perf_counter() - started
    return grade


def reference_for(path: str, reference_dir: str) -> str | None:
    """The solution notebook a learner's file answers: same name, give or take the
    'Copy of ' that Colab's "Save a copy in Drive" adds and a ' (1)' from a re-download."""
    name = os.path.basename(path)
    candidates = [name, re.sub(r"^Copy of ", "", re.sub(r"\s*\(\d+\)(?=\.ipynb$)", "", name))]
    for candidate in candidates:
        ref = os.path.join(reference_dir, candidate)
        if os.path.exists(ref):
            return ref
    return None


def find_notebooks(paths):
    found = []
    for p in paths:
        if os.path.isdir(p):
            found += sorted(f for f in glob.glob(os.path.join(p, "**", "*.ipynb"), recursive=True)
                            if ".ipynb_checkpoints" not in f)
        elif os.path.exists(p):
            found.append(p)
        else:
            raise FileNotFoundError(p)
    return found


def table(grades, base: str) -> str:
    rows = []
    for g in grades:
        label = os.path.relpath(g.path, base) if base else g.path
        marks = "  ".join(f"{q.name} {'ok' if q.passed else 'FAIL'}" for q in g.questions)
        for extra in (g.error, g.note):
            if extra:
                marks = (marks + "  " if marks else "") + f"[{extra}]"
        rows.append((label, f"{g.passed}/{g.total}", marks))
    width = max([len("notebook")] + [len(r[0]) for r in rows])
    lines = [f"{'notebook':<{width}}  score  questions", f"{'-' * width}  -----  ---------"]
    lines += [f"{label:<{width}}  {score:>5}  {marks}" for label, score, marks in rows]
    total = sum(g.total for g in grades)
    passed = sum(g.passed for g in grades)
    lines.append(f"{'total':<{width}}  {f'{passed}/{total}':>5}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", help="notebooks or folders (default: exercises/)")
    parser.add_argument("--reference", default=os.path.join(ROOT, "solutions"),
                        help="folder of solved notebooks with the expected check outputs (default: solutions/)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell (default 300)")
    parser.add_argument("--csv", help="also write notebook,question,passed,output rows to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="print what each failed question printed")
    args = parser.parse_args(argv)
    paths = args.paths or [os.path.join(ROOT, "exercises")]
    try:
        notebooks = find_notebooks(paths)
    except FileNotFoundError as exc:
        print(f"error: no such file or folder: {exc}", file=sys.stderr)
        return 2
    if not notebooks:
        print(f"error: no notebooks under {', '.join(paths)}", file=sys.stderr)
        return 2
    base = paths[0] if len(paths) == 1 and os.path.isdir(paths[0]) else ""
    grades = []
    for path in notebooks:
        grades.append(grade_notebook(path, args.reference, args.timeout))
        g = grades[-1]
        print(f"graded {path}: {g.passed}/{g.total} ({g.seconds:.0f} s)", file=sys.stderr, flush=True)
    print(table(grades, base))
    if args.verbose:
        for g in grades:
            for q in g.questions:
                if not q.passed:
                    print(f"{g.path}: {q.name}: {q.got}")
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["notebook", "question", "passed", "output"])
            for g in grades:
                for q in g.questions:
                    writer.writerow([g.path, q.name, int(q.passed), q.got])
                if g.error:
                    writer.writerow([g.path, "", "", g.error])
    return 0 if all(g.total and g.passed == g.total for g in grades) else 1


if __name__ == "__main__":
    sys.exit(main())
